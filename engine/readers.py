"""Reader threads and their queue: expert reads off the main thread.

A `ReaderPool` runs `n` daemon threads ("reader-0", ...) that take read jobs from one queue and
call `ExpertStore.read_bundle` / `read_layer` into PREALLOCATED buffers (slot rows, hot-pool
rows, whole-layer stacks): a read from the device releases the GIL, so reads overlap with
`mx.eval` on the main thread (machine-notes; allocating a fresh array per read does not
overlap); a small bundle's copy out of the page cache keeps it (engine.store).

`submit_*` returns a `Ticket` at once. The main thread calls `wait(tickets)` only for what it
needs now; the time it is blocked is split over the tickets without overlap (tickets in finish
order, each charged from max(wait start, previous finish) to its own finish, the wake-up
latency to the last), so the load rows' `wait_ns` sum to the real blocked time. Rows are
emitted from the main thread when waited on, with `step` = the step that consumed the load.
A failed read re-raises its `ExpertReadError` (naming layer, expert and file) from `wait`,
after every ticket of the batch has finished, so no reader still writes into a buffer that
the caller is about to reuse.

With `native` (EngineConfig.native_reads, where engine.native_reads can build its pool) a
queued bundle read goes to native threads instead: one `preadv` with no Python on the read
path, so it starts as soon as a thread is free, not when the main thread next lets go of the
interpreter lock. The main thread plans it (charging the page-cache budget, whose victims the
native thread drops after the read) and makes its row when it waits: the Python a reader did
moves to the main thread. With `help_main`, a native read no pool thread has started when the
main thread waits for it is taken off the pool's queue and run on the main thread (in C, the
interpreter lock released), as a Python reader's unstarted read is. Whole-layer reads,
O_DIRECT and bundles of several runs stay on the Python threads."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping

import numpy as np

from contract.thresholds import INLINE_WARM_BYTES  # the policy, shared with the simulator
from engine import native_reads
from engine.paths.stats import PathStats
from engine.step_clock import StepClock
from engine.store import NATIVE_THREAD, ExpertStore, NativeRead
from traces.schema import DEMAND, WHOLE_LAYER


class Ticket:
    __slots__ = ("layer", "expert", "source", "issued_ns", "event", "row", "error", "emitted",
                 "into", "whole", "claimed", "queued", "cold", "job", "native", "helped")

    def __init__(self, layer: int, expert: int, source: str, into, whole: bool):
        self.layer, self.expert, self.source = layer, expert, source
        self.into, self.whole = into, whole
        self.issued_ns = time.perf_counter_ns()
        self.event = threading.Event()
        self.row: dict | None = None
        self.error: BaseException | None = None
        self.emitted = False
        self.claimed = False  # a thread (reader or main) has taken this read
        self.queued = False  # handed to the readers' queue
        self.cold = False  # known not cached (a warm-only attempt was refused)
        self.job: native_reads.Job | None = None  # handed to the native pool
        self.native: NativeRead | None = None
        self.helped = False  # a native read the main thread ran itself (help_main)

    def done(self) -> bool:
        """Landed (a native read may be done before anyone has waited for it)."""
        return self.event.is_set() or (self.job is not None
                                       and self.job.state == native_reads.DONE)

    def finished_ns(self) -> int:
        return self.row["finished_ns"] if self.row else 0


class ReaderPool:
    """`help_main`: when the main thread must wait for a read that no reader has started yet
    (readers busy, or not yet scheduled on a loaded machine), it does that read itself instead
    of sleeping through a thread hand-off; reads a reader has started are waited for. Reads
    submitted with `now=True` (the caller waits for them at once: on-demand fills) are not
    queued at submit; `wait` does those the page cache holds on the main thread when bundles
    are small (`INLINE_WARM_BYTES`: a copy cheaper than waking a reader, and on a small machine
    readers compete with MLX's compute thread for cores), keeps the first of the others for the
    main thread and queues the rest, so several cold (or large) misses still read in
    parallel. Rows say which thread read (`thread`)."""

    def __init__(self, store: ExpertStore, n: int = 2, stats: PathStats | None = None,
                 help_main: bool = True, step_clock: StepClock | None = None,
                 native: bool = False):
        if n < 1:
            raise ValueError(f"readers: need at least 1, got {n}")
        # `kind`: who reads queued bundles, "native" or "python" (`why_python`: why not native)
        self._native_lib, self.why_python = native_reads.load() if native else (
            None, "native reads off")
        self.kind = "native" if self._native_lib is not None else "python"
        self._native: native_reads.NativePool | None = None  # started on first use
        self.store = store
        self.step_clock = step_clock if step_clock is not None else StepClock()
        self.stats = stats or PathStats()
        self.n = n
        self.help_main = help_main
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._claim_lock = threading.Lock()
        self._threads: list[threading.Thread] = []  # started on first use
        self._cpu_clocks: list[int] | None = None  # their kernel CPU clocks (cpu_ns)

    def _start(self) -> None:
        self._threads = [threading.Thread(target=self._run, args=(f"reader-{i}",),
                                          name=f"reader-{i}", daemon=True)
                         for i in range(self.n)]
        for t in self._threads:
            t.start()
        clock_of = getattr(time, "pthread_getcpuclockid", None)  # absent on macOS
        self._cpu_clocks = [clock_of(t.ident) for t in self._threads] if clock_of else None

    def cpu_ns(self) -> int:
        """The CPU time every reader thread (Python and native) has used so far, ns, from
        the kernel's per-thread CPU clocks (wake-ups included, not only reads); -1 where a
        thread's clock cannot be read (macOS). Threads not started yet have used none."""
        total = 0
        if self._threads:
            if self._cpu_clocks is None:
                return -1
            try:
                total += sum(time.clock_gettime_ns(c) for c in self._cpu_clocks)
            except OSError:  # a thread gone (the pool closing)
                return -1
        if self._native is not None:
            native = self._native.cpu_ns()
            if native < 0:
                return -1
            total += native
        return total

    # ------------------------------------------------------------ submit (main thread)

    def _submit(self, t: Ticket, now: bool) -> Ticket:
        if not (now and self.help_main):
            self._enqueue(t)
        return t

    def _enqueue(self, t: Ticket) -> None:
        t.queued = True
        if self._native_lib is not None and not t.whole and self._submit_native(t):
            return
        if not self._threads:
            self._start()
        self._q.put(t)

    def _submit_native(self, t: Ticket) -> bool:
        """Hand a bundle read to the native pool; False where it is not one plain read."""
        read = self.store.native_read(t.layer, t.expert, t.into)
        if read is None:
            return False
        if self._native is None:
            self._native = native_reads.NativePool(self.n, self._native_lib)
        t.claimed = True  # no Python thread, and not the main thread, takes it
        t.native = read
        f = read.file
        t.job = self._native.submit(f.fd, read.run.offset, read.run.length, read.iovecs,
                                    f.addr, read.drops)
        return True

    def _finish_native(self, tickets: list[Ticket]) -> None:
        """Wait for the native reads of `tickets` not yet finished; make their rows."""
        if self._native is None:  # no native read was ever submitted (the default readers)
            return
        mine = [t for t in tickets if t.job is not None and not t.event.is_set()]
        if not mine:
            return
        self._native.wait([t.job for t in mine])
        for t in mine:
            try:
                t.row = self.store.finish_native(t.layer, t.expert, t.native, t.job,
                                                 source=t.source, issued_ns=t.issued_ns,
                                                 thread="main" if t.helped else NATIVE_THREAD)
            except BaseException as err:  # noqa: BLE001 - raised by wait, like a reader's
                t.error = err
            t.into = t.native = t.job = None
            t.event.set()

    def submit_bundle(self, layer: int, expert: int, into: Mapping[str, np.ndarray],
                      source: str = DEMAND, now: bool = False) -> Ticket:
        return self._submit(Ticket(layer, expert, source, into, False), now)

    def submit_layer(self, layer: int, into: Mapping[str, np.ndarray],
                     source: str = WHOLE_LAYER, now: bool = False) -> Ticket:
        return self._submit(Ticket(layer, -1, source, into, True), now)

    # ------------------------------------------------------------ wait (main thread)

    def wait(self, tickets: list[Ticket]) -> int:
        """Block until every ticket is done; emit their rows; return ns blocked. Raises the
        first read error after all are done."""
        if not tickets:
            return 0
        start = time.perf_counter_ns()
        held = [t for t in tickets if not t.queued and not t.claimed]  # submitted with now=True
        if self.help_main and self.store.manifest.bundle_bytes <= INLINE_WARM_BYTES:
            held = [t for t in held if not self._execute_if_warm(t)]  # small warm ones, here
        for t in held[1:]:  # cold: the first on this thread, the others in parallel
            self._enqueue(t)
        if self.help_main:
            for t in tickets:
                if not t.claimed and self._claim(t):
                    self._execute(t, "main")
                elif t.job is not None and t.job.state == 0 and self._native.help(t.job):
                    t.helped = True  # a native read no pool thread had started: read here
        self._finish_native(tickets)
        for t in tickets:
            t.event.wait()
        end = time.perf_counter_ns()
        blocked = end - start if any(t.finished_ns() > start or t.error for t in tickets) else 0
        ok = sorted((t for t in tickets if t.row is not None), key=Ticket.finished_ns)
        prev = start
        for i, t in enumerate(ok):
            fin = end if i == len(ok) - 1 else t.finished_ns()
            w = max(0, fin - max(prev, start)) if t.finished_ns() > start else 0
            prev = max(prev, t.finished_ns())
            self._emit(t, w)
        self.stats.blocked_ns += blocked
        for t in tickets:
            if t.error is not None:
                raise t.error
        return blocked

    def _emit(self, t: Ticket, wait_ns: int) -> None:
        if t.emitted:
            return
        t.emitted = True
        row = t.row
        row["step"] = self.step_clock.step  # the step waiting for it
        row["waited"] = wait_ns > 0
        row["wait_ns"] = wait_ns
        self.store.emit(row)

    def drain(self, tickets) -> None:
        """Wait for tickets without raising (cleanup after a failure)."""
        for t in tickets:
            if not t.queued and self._claim(t):
                self._execute(t, "main")
        self._finish_native(list(tickets))
        for t in tickets:
            t.event.wait()

    # ------------------------------------------------------------ threads

    def _claim(self, t: Ticket) -> bool:
        with self._claim_lock:
            if t.claimed:
                return False
            t.claimed = True
            return True

    def _execute_if_warm(self, t: Ticket) -> bool:
        """Do a held bundle read on the main thread if the page cache holds all of it."""
        if t.whole:
            return False
        try:
            row = self.store.read_bundle_if_warm(t.layer, t.expert, t.into, source=t.source,
                                                 thread="main", issued_ns=t.issued_ns)
        except BaseException as err:  # noqa: BLE001 - raised by wait, like a reader's
            row, t.error = None, err
        if row is None and t.error is None:
            t.cold = not self.store.direct  # refused because not cached (O_DIRECT: never tried)
            return False
        t.claimed = True  # held: no reader has seen it
        t.row = row
        t.into = None
        t.event.set()
        return True

    def _execute(self, t: Ticket, name: str) -> None:
        try:
            if t.whole:
                t.row = self.store.read_layer(t.layer, t.into, source=t.source, thread=name,
                                              issued_ns=t.issued_ns, waited=False, emit=False)
            else:
                t.row = self.store.read_bundle(t.layer, t.expert, t.into, source=t.source,
                                               thread=name, issued_ns=t.issued_ns,
                                               waited=False, emit=False, known_cold=t.cold)
        except BaseException as err:  # noqa: BLE001 - handed to the waiting main thread
            t.error = err
        t.into = None
        t.event.set()

    def _run(self, name: str) -> None:
        while True:
            t = self._q.get()
            if t is None:
                return
            if self._claim(t):
                self._execute(t, name)

    def close(self) -> None:
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []
        if self._native is not None:
            self._native.close()  # runs what is queued, then joins
            self._native = None
