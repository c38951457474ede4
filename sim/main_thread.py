"""The main thread: the one SimPy process of the model.

Two decode loops, as the engine has (engine.generate), chosen by the scenario's `lookahead`:

Synchronous (lookahead false: the paper's engine, and ours when a decode layer syncs while its
graph is built, i.e. the exact and hot paths). Per decode step:
  boundary  the policy stages predicted sets (prefetches issued; with no reader threads the main
            thread performs them itself, synchronously, as the paper's stager does)
  per layer build the layer's graph (CPU; + a head's graph at head owners), queue its attention
            (+ head) work on the accelerator; unless the layer's routing is staged, sync on the
            router (wait for the accelerator), then get every routed bundle (its slot on the
            staged path, the bundle LRU, else a demand load) and wait for those still in
            flight; queue the expert work
  end       sync on the accelerator (sampling needs the token)

Lookahead (lookahead true: our engine's staged decode loop, engine.generate / fill_points).
Step t's work is queued as soon as its graph is built and runs at once (async eval: never lazy);
while it computes the main thread builds step t+1's graph and, layer by layer, resolves step
t's fill points. Per decode step t (a window of wall time, as the engine's trace rows are):
  start     step t's graph was built in the previous window and its layer 0 attention queued,
            its predicted sets staged (the first decode step of a request builds its own graph
            and stages its sets first); the main thread does token t-1's host work
            (`token_host_ms`: the recorder's row), holding the GIL, as eval time
  per layer build layer l of step t+1 (+ its head), then step t's next unresolved fill point
            (the rest after the build): sync on its router (unless staged: then only the
            staged loads are waited for), the loads as above, then queue its experts and the
            walk to the next routed layer's attention (+ head); a predicted layer's attention
            goes with its own experts
  end       sync on step t's token; begin(t+1) (`begin`): step t+1's predicted sets are
            staged (their reads start): the heads computed them as a side output of step t's
            final evaluation, so their ids reach the host with its token
            (engine.generate.finish: one sync in fill_points.begin); step t+1's layer 0
            attention is queued (the in-order stream runs it after the token); with a token
            lead (layer 0 routed, every later layer predicted) step t+1's layer 0 and layer 1
            fill points are resolved here too, so the window's builds resolve layers 2..
  Work is handed over as async_eval does (`queue_async`): where the stream's queue is bounded
  (hardware queue_ahead_ms: MLX's CPU backend) the main thread waits, as eval, until little is
  left queued, so it builds only beside that little. Before each layer's hand-over the main
  thread prepares and dispatches its operations (model fill_ms_per_layer: `dispatch`), with
  the queue that nearly empty, so compute waits on it. The synchronous loop has no such
  charge: its router syncs dispatch inside the sync, and calibrate's synced compute, which
  its eval is made of, was timed the same way.
  In both loops the dispatch's CPU (model dispatch_cpu_ms_per_layer; in the lookahead loop
  less the serial part just paid for the same operations, so once a layer) is owed for each
  layer handed over and paid on this thread, without the GIL,
  while it next waits on compute: a core's time beside the compute thread, which starts each
  layer's attention waiting for it (model compute_wait_ms_per_layer, sim.compute_stream). On
  enough cores neither changes a step's time; on one core, or under a CPU quota, they are what
  the two threads take from each other.
  The window is [end of the previous window, token t on the host]; build = step t+1's graph
  building in it, eval = the rest net of blocked (fill host work included).

Per prefill step: whole-layer loads, layer L+1's load overlapping layer L's compute
(MainThread.prefill_step).

The main thread is one SimPy process; the others are sim.compute_stream (the accelerator, or on
a CPU backend a compute thread on the host's cores), sim.reader_threads (reader threads) and the
storage device; graph building, fills, copies and faults ask sim.cpu for CPU time. With the
hardware's lazy_compute, work queued by the synchronous loop or a prefill starts only at the next
sync; a sync that finds work queued or running costs sync_overhead_ms more. Times are seconds.
Blocked time = main thread waiting on (or itself performing) expert loads (a wait on a reader's
load includes the hardware's thread hand-off, handoff_ms: sim.reader_threads); eval time =
waiting on the accelerator; build time = graph building (and, in the synchronous loop, slot
rewrites).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Generator
from typing import Any

import simpy

from sim import expert_kernel, zero_fill
from sim.caches import BundleLRU, SlotTables
from sim.compute_stream import ComputeStream
from sim.cpu import READER_THREAD, Cores
from sim.loads import Fetcher, Load
from sim.policies import Policy
from sim.reader_threads import INLINE_WARM_BYTES, ReaderThreads
from sim.record import StepLog
from sim.routing_input import PREFILL_TOKEN
from sim.scenario import Scenario
from sim.swap import Swap
from traces.schema import DEMAND, PREFETCH, WHOLE_LAYER

MAIN_THREAD = "main"
# what the main thread's CPU goes to, as reports/cross-machine/main_thread_cpu.py splits the
# engine's: graph building, MLX's dispatch (inside async_eval), a fill point's host work (slot
# tables, read plans; the lookahead loop), expert loads it reads or collects itself, the rest
MAIN_PARTS = ("build", "dispatch", "fills", "loads", "other")


def engine_order(experts: list[int], held) -> list[int]:
    """The order the engine's fills show a call's experts to the cache policy: all held (the
    all-hit short paths: a Python set's order, built from the same list), else sorted
    (engine.paths.hot.HotPool.rows_for, SlotTable.place)."""
    if all(e in held for e in experts):
        return list(set(experts))
    return sorted(experts)


class MainThread:
    def __init__(self, env: simpy.Environment, sc: Scenario, policy: Policy, cores: Cores,
                 compute: ComputeStream, fetcher: Fetcher, readers: ReaderThreads | None,
                 lru: BundleLRU, swap: Swap,
                 hints: dict[int, list[tuple[int, list[int]]]] | None = None) -> None:
        m, hw = sc.model, sc.hardware
        self.env = env
        self.sc = sc
        self.policy = policy
        self.cores = cores
        self.compute = compute
        self.fetcher = fetcher
        self.readers = readers
        self.lru = lru
        self.swap = swap
        # routing row -> [(layer, experts)] to hint at its step's begin (lookahead loop only)
        self.hints = (hints or {}) if sc.lookahead else {}
        self.gil = fetcher.gil
        # (Belady runs on the hot path only: sim.profiles.check_scenario; no slots there)
        self.slots = SlotTables(m.layers, sc.staged_slots,
                                "lru" if sc.cache_policy == "belady" else sc.cache_policy)
        self.thread_cpu_seen: dict[str, float] = {}  # the cores' CPU seconds by thread at the
        # last row
        self.decode_cpu_s: Counter[str] = Counter()  # decode rows' CPU by thread (readers as one)
        # the main thread's CPU by part (MAIN_PARTS) since the last row, and the decode rows'
        self.main_parts: Counter[str] = Counter()
        self.decode_main_parts: Counter[str] = Counter()
        self.layers = m.layers
        self.experts = m.experts
        self.bundle_bytes = m.bundle_bytes
        lora = sc.lora  # the adapter's delta runs beside every layer's attention
        self.build_s = (m.build_ms_per_layer + (m.lora_build_ms if lora else 0.0)) \
            * hw.cpu_factor / 1e3
        self.head_build_s = m.head_build_ms * hw.cpu_factor / 1e3
        self.dispatch_s = m.fill_ms_per_layer * hw.cpu_factor / 1e3
        # MLX's dispatch of a layer's operations on this thread, paid while it waits on compute
        self.dispatch_cpu_s = m.dispatch_cpu_ms_per_layer * hw.cpu_factor / 1e3
        self.dispatch_owed = 0.0
        # ... which each layer's attention waits for first, on a CPU backend (sim.compute_stream)
        self.compute_wait_s = m.compute_wait_ms_per_layer * hw.cpu_factor / 1e3
        bw = hw.mem_bandwidth_gbps * 1e9 / hw.compute_factor
        self.attn_s = (m.resident_bytes - m.unembed_bytes
                       + (m.lora_bytes if lora else 0)) / m.layers / bw
        self.unembed_s = m.unembed_bytes / bw  # logits, after the last layer
        # the kernel's time per byte is measured at the model's bundle size: the in-decode
        # factor, fitted where that time is small, does not scale it (sim.expert_kernel)
        rate = expert_kernel.expert_gbps(hw, m.bundle_bytes)
        expert_bw = rate * 1e9 if rate else bw
        self.expert_s = (sc.k * m.bundle_bytes / expert_bw
                         + hw.expert_overhead_ms * hw.compute_factor / 1e3)
        self.head_s = (m.head_read_bytes or m.head_bytes) / bw  # what a head reads a step
        if hw.threads_share_one_core:  # hand-overs to the compute thread stay on one core
            self._one_core(m.primitives_per_layer, hw.cross_core_op_us / 1e6,
                           hw.cross_core_op_main_us / 1e6)
        self.flops = hw.compute_tflops * 1e12 / hw.compute_factor
        self.mem_bw = bw
        self.slot_update_s = hw.slot_update_ms / 1e3
        self.refused_warm_s = hw.refused_warm_ms / 1e3
        # a staged fill's host work per expert it loads (the slot table's place and settle)
        self.fill_host_s = hw.fill_host_ms_per_load / 1e3 if policy.slots else 0.0
        # the exact path's fresh zeroed stack per call (engine.paths.kernel.alloc_stack)
        fill = zero_fill.fill_gbps(hw, zero_fill.step_touched_bytes(m, sc.k))
        self.stack_fill_s = m.bundle_bytes / (fill * 1e9) \
            if policy.fresh_stack and fill > 0 else 0.0
        self.lookahead = sc.lookahead
        # the bounded queue's compute left after a hand-over ending in a layer's experts
        # (None: the hardware's queue_ahead_ms; sim.compute_stream)
        self.gather_ahead_s = hw.gather_queue_ahead_ms / 1e3 \
            if hw.gather_queue_ahead_ms >= 0 else None
        # lookahead loop: the fill points of the step being evaluated not yet resolved, in
        # layer order
        self.unresolved: list[int] = []
        # a token lead's steps (layer 0 routed, every later layer predicted) resolve their
        # routed head as they begin (engine.fill_points.begin); fixed per run
        staged = [policy.staged_layer(layer) for layer in range(m.layers)]
        self.head_at_begin = bool(staged) and not staged[0] and all(staged[1:])
        owners = [policy.head_owner(layer) for layer in range(m.layers)]  # fixed per run
        self.layer_build_s = [self.build_s + (self.head_build_s if o else 0.0) for o in owners]
        self.layer_attn_s = [self.attn_s + (self.head_s if o else 0.0) for o in owners]
        self.log = StepLog()
        self.executed_log: list[list[int]] = []  # per decode step and layer, the executed set
        self.warnings: list[str] = []
        self.begin_step()

    @property
    def now(self) -> float:
        return self.env.now

    # -- primitives (each a SimPy sub-process: `yield from`) --------------------------------
    def begin_step(self) -> None:
        self.build = self.eval = self.blocked = 0.0
        self.cold_waits = 0  # loads waited on that were cold (a fill's cold stall)
        self.hits = self.misses = 0
        self.evictions0 = self.lru.evictions + self.slots.evictions

    def cpu(self, seconds: float, part: str = "build") -> Generator:
        """Graph building on the main thread (Python: it holds the GIL, sim.gil), counted as
        `part` of its CPU (a fill's host work in the synchronous loop: "fills")."""
        start = self.env.now
        yield from self._as(part, self.gil.run(self.cores, seconds, MAIN_THREAD))
        self.build += self.env.now - start

    def _as(self, part: str, charge: Generator) -> Generator:
        """Run `charge` (main-thread work, a sub-process) and count the main thread's CPU it
        took as `part` (MAIN_PARTS; the cores charge work as it is handed to them)."""
        before = self.cores.busy_s[MAIN_THREAD]
        yield from charge
        self.main_parts[part] += self.cores.busy_s[MAIN_THREAD] - before

    def _one_core(self, primitives: float, wall_s: float, main_s: float) -> None:
        """The compute figures (a synced step's wall time) and the dispatch (the main thread's
        CPU inside async_eval) are measured with the main and compute threads on separate
        cores, where each operation handed over costs `wall_s` more wall time and `main_s` more
        main-thread CPU than on one core (hardware cross_core_op_us, cross_core_op_main_us):
        on one core each layer's compute, split over attention and experts as it is, and the
        dispatch take `primitives` x those less. And the compute thread no longer waits for the
        dispatch beside it (model compute_wait_ms_per_layer, the first part of each layer's
        attention, measured on separate cores): on one core, while it waits, the core runs the
        main thread's dispatch, which is charged as the main thread's CPU. Kept as a wait there,
        it left the core idle whenever the main thread waited on compute in turn."""
        saving = primitives * wall_s
        layer_s = self.attn_s + self.expert_s
        if saving and layer_s:
            self.attn_s, self.expert_s = (max(0.0, s - saving * s / layer_s)
                                          for s in (self.attn_s, self.expert_s))
        self.attn_s = max(0.0, self.attn_s - self.compute_wait_s)  # its CPU alone
        self.compute_wait_s = 0.0
        self.dispatch_s = max(0.0, self.dispatch_s - primitives * main_s)
        self.dispatch_cpu_s = max(0.0, self.dispatch_cpu_s - primitives * main_s)

    def fill_cpu(self, seconds: float, part: str = "fills") -> Generator:
        """Main-thread host work of a fill point (lookahead loop): not graph building; counted
        as `part` of the main thread's CPU (the previous token's record: "other")."""
        start = self.env.now
        yield from self._as(part, self.gil.run(self.cores, seconds, MAIN_THREAD))
        self.eval += self.env.now - start

    def dispatch(self, seconds: float) -> Generator:
        """Handing a layer's work over at its fill point (lookahead loop; model
        fill_ms_per_layer): MLX prepares and dispatches each operation on the calling thread
        inside async_eval, which releases the GIL, so a core but not the lock; compute waits
        on it, so eval time. It is the dispatch of the fill's gather and of the walk to the
        next router (engine.fill_points.progress: two async_evals), so the attention handed
        over after it owes only what this left out (`queue_attention_async`)."""
        if seconds > 0:
            start = self.env.now
            self.main_parts["dispatch"] += seconds
            yield self.cores.work(seconds, MAIN_THREAD)
            yield from self.gil.take_back()
            self.eval += self.env.now - start

    def gpu_sync(self) -> Generator:
        """Wait until the compute stream has run everything queued (the host needs a value)."""
        self.eval += yield from self._wait_for_compute()

    def _wait_for_compute(self) -> Generator[Any, Any, float]:
        """Wait until the compute stream has run everything queued; the seconds waited."""
        done = self.compute.sync()
        if done is None and not self.dispatch_owed:  # everything queued has run
            return 0.0
        start = self.env.now
        yield from self._dispatching(done)
        yield from self.gil.take_back()  # eval let go of it (sim.gil)
        return self.env.now - start

    def _owe_dispatch(self) -> None:
        """A layer's operations were handed over: the main thread dispatches them (MLX, on the
        calling thread) the next time it waits on compute."""
        self.dispatch_owed += self.dispatch_cpu_s

    def _dispatching(self, done: simpy.Event | None) -> Generator:
        """Wait for `done` (None: nothing to wait for) while dispatching what is owed: the
        dispatch's CPU (model dispatch_cpu_ms_per_layer) runs on this thread beside the compute
        thread's work, holding a core but not the GIL (MLX releases it in eval)."""
        owed, self.dispatch_owed = self.dispatch_owed, 0.0
        if owed > 0:
            work = self.cores.work(owed, MAIN_THREAD)
            self.main_parts["dispatch"] += owed
            yield work if done is None else simpy.AllOf(self.env, [done, work])
        elif done is not None:
            yield done

    def new_load(self, step: int, layer: int, expert: int, key: int, nbytes: int, pieces: int,
                 source: str, hold: bool = False) -> Generator:
        """Issue a load (a generator returning it: `load = yield from ...`). `hold`: a demand
        load the caller hands out itself (`_hand_out`) once it knows all of a fill's misses."""
        env = self.env
        if self.fill_host_s and expert >= 0:  # the slot table places it, plans its read
            yield from (self.fill_cpu if self.lookahead else self.cpu)(self.fill_host_s,
                                                                       "fills")
        load = Load(step, layer, expert, key, nbytes, pieces, source, env.now, env.event())
        # A small demand read the page cache holds is a copy the engine's main thread does
        # itself (engine.readers.INLINE_WARM_BYTES: cheaper than a reader hand-off); others
        # go to the readers.
        small = source == DEMAND and nbytes <= INLINE_WARM_BYTES
        inline = small and self.fetcher.pc.holds(key)
        if self.readers is not None and not inline:
            if hold and small and self.sc.help_reads and self.refused_warm_s \
                    and not self.sc.o_direct:  # (O_DIRECT: never asked)
                # the engine asked the page cache first and was refused (engine.readers.wait):
                # main-thread work inside the fill's wait, so blocked time
                start = self.env.now
                yield from self._as("loads", self.gil.run(self.cores, self.refused_warm_s,
                                                          MAIN_THREAD))
                self._blocked(start)
            if not hold:
                self.readers.submit(load)
        else:  # the main thread reads it now and is blocked meanwhile
            yield from self._perform_here(load)
        return load

    def _perform_here(self, load: Load) -> Generator:
        """The main thread reads `load` itself: blocked until its bytes are in. The budget's
        page drops after the read (sim.loads) are blocked time too where the read is a reader
        pool's ticket (engine.readers.wait times the wait up to the ticket's event, set after
        the drops); a path without readers reads inside graph building or a fill (the exact
        path: engine.store's load row ends before the drops), so there they are that work."""
        start = self.env.now
        yield from self._as("loads", self.fetcher.perform(load, MAIN_THREAD))
        self._waited_on(load)
        end = self.env.now if self.readers is not None else load.finished
        load.wait += end - start
        self._blocked(start, end)
        after = self.env.now - end
        if after > 0:
            if self.lookahead:
                self.eval += after
            else:
                self.build += after

    def _hand_out(self, held: list[Load]) -> None:
        """A fill point's demand misses (engine.readers.wait): with help_reads the main thread
        keeps the first for itself and queues the others, so several still read in parallel."""
        keep = 1 if self.sc.help_reads else 0
        for load in held[keep:]:
            self.readers.submit(load)

    def wait(self, load: Load) -> Generator:
        if load.done.triggered:
            yield from self._collect(load)
            return
        # no reader has started it: the main thread reads it (the reader that finds it skips
        # it; engine.readers takes a native read off the pool's queue the same way)
        if self.readers is not None and load.started < 0 and self.sc.help_reads:
            yield from self._perform_here(load)
            return
        start = self.env.now
        yield load.done
        if self.readers is not None:
            yield self.env.timeout(self.readers.handoff_s)
        yield from self.gil.take_back()  # the wait let go of it (sim.gil)
        yield from self._collect(load)
        self._waited_on(load)
        load.wait += self.env.now - start
        self._blocked(start)

    def _collect(self, load: Load) -> Generator:
        """A native read's Python, the main thread's when it waits (engine.readers): its plan
        and its row, holding the GIL."""
        if load.owed:
            owed, load.owed = load.owed, 0.0
            yield from self._as("loads", self.gil.run(self.cores, owed, MAIN_THREAD))

    def _waited_on(self, load: Load) -> None:
        """The main thread waited on `load` (or read it itself): a cold one is a cold stall."""
        load.waited = True
        self.cold_waits += load.cold

    def cache_hit(self, key: int) -> Generator:
        """An app-cache hit: free unless memory is oversubscribed and its pages were swapped
        out (sim.swap), then a swap-in read on the main thread."""
        cost = self.swap.hit_cost(self.env.now, self.bundle_bytes)
        if cost > 0:
            start = self.env.now
            yield self.env.timeout(cost)
            self._blocked(start)

    def _blocked(self, start: float, end: float | None = None) -> None:
        """The main thread was blocked from `start` to `end` (now)."""
        self.blocked += (self.env.now if end is None else end) - start

    # -- caches -----------------------------------------------------------------------------
    def stage(self, step: int, layer: int, predicted: list[int]) -> Generator:
        """Stage `predicted` for `layer`'s next call (engine.paths.staged_fill.PredictedFill):
        held experts keep their slots, the others get one outside the last call's (which may
        still compute), filled from the bundle LRU or by a prefetch."""
        slots, lru = self.slots, self.lru
        predicted = sorted(predicted)  # the engine places a call's experts sorted
        keep = slots.protected(layer, last_call=True) | set(predicted)
        slots.touch(layer, predicted)
        held = slots.held[layer]
        staged: dict[int, object] = {}
        base = layer * self.experts
        pinned = [base + e for e in predicted]  # the bundle cache keeps the set being staged
        for e in predicted:
            if e in held:
                staged[e] = held[e]
                continue
            key = base + e
            if lru.lookup(key, (step, layer)):
                load = lru.get(key)
            else:
                load = yield from self.new_load(step, layer, e, key, self.bundle_bytes,
                                                self.sc.prefetch_pieces, PREFETCH)
                lru.insert(key, (step, layer), load, keep=pinned)
            slots.place(layer, e, load, keep)
            staged[e] = load
        slots.stage(layer, staged)

    def hint(self, step: int, row: int) -> Generator:
        """begin(step) with a first-layer hint (engine.first_layer_hint): the trace's hinted
        experts of routing row `row` start reading as prefetches into their layer's slots, as
        engine.paths.slot_table.SlotTable.hint places them: never over a read in flight, and
        always leaving K slots without one."""
        slots = self.slots
        for layer, experts in self.hints.get(row, ()):
            held = slots.held[layer]
            busy = {e for e, load in held.items()
                    if load is not None and not load.done.triggered}
            room = slots.capacity - len(busy) - self.sc.k
            missing = [e for e in dict.fromkeys(experts) if e not in held][:max(0, room)]
            if not missing:
                continue
            slots.calls[layer] += 1  # the engine's hint ticks the table's clock
            base = layer * self.experts
            for e in missing:
                load = yield from self.new_load(step, layer, e, base + e, self.bundle_bytes,
                                                self.sc.prefetch_pieces, PREFETCH)
                slots.place(layer, e, load, busy | set(missing))

    def stage_boundary(self, step: int, row: int) -> Generator:
        """Stage what the policy predicted for decode step `step` (routing row `row`) at its
        boundary (the token lead's sets of every consumer layer)."""
        for layer, predicted in self.policy.boundary(row):
            yield from self.stage(step, layer, predicted)

    def _staged_layer(self, step: int, row: int, layer: int) -> Generator:
        executed = self.policy.executed(row, layer)
        staged = self.slots.take(layer) or {}
        for e in executed:
            load = staged.get(e)
            if load is None:
                self.hits += 1
                continue
            yield from self.wait(load)
            self.slots.landed(layer, e)
            if load.step == step and load.source == PREFETCH:
                self.misses += 1
            else:
                self.hits += 1
        return executed

    def _router_layer(self, step: int, row: int, layer: int,
                      routed: tuple[list[int], list[Load]] | None = None) -> Generator:
        """A routed layer's fill: `_route` (unless `routed` holds what it returned, its loads
        issued earlier), then its loads waited for."""
        executed, need = routed if routed is not None else (
            yield from self._route(step, row, layer))
        for load in need:
            yield from self.wait(load)
        if self.policy.slots:
            for e in executed:
                self.slots.landed(layer, e)
        return executed

    def _route(self, step: int, row: int, layer: int) -> Generator:
        """Sync on `layer`'s router, then get every routed bundle (its slot, the bundle LRU,
        else a demand load, issued here). Returns (executed experts, loads to wait for)."""
        policy, lru, slots = self.policy, self.lru, self.slots
        yield from self.gpu_sync()  # the router's indices must reach the host
        for target, predicted in policy.after_router(row, layer):
            yield from self.stage(step, target, predicted)
        executed = policy.executed(row, layer)
        if self.stack_fill_s:
            yield from self._fill_stack(len(set(executed)))
        if policy.slots:
            slots.take(layer)  # a set staged for this call (layer lead) is held in its slots
            slots.touch(layer, engine_order(executed, slots.held[layer]))
            keep = slots.protected(layer, last_call=False) | set(executed)
        base = layer * self.experts
        need: list[Load] = []
        held: list[Load] = []
        in_slots = slots.held[layer] if policy.slots else {}
        call = [base + e for e in executed]  # pinned while this call's misses pick victims
        order = sorted(executed) if policy.slots else executed  # SlotTable.place: sorted
        room = 0  # the hot pool frees the rows of all of a call's misses before it admits any
        if policy.app_cache and not policy.slots:  # the hot pool, as the engine takes a call
            held_keys = {e for e in executed if base + e in lru}
            room = len(set(executed)) - len(held_keys)
            order = sorted(executed, key=lambda e: (e not in held_keys, e)) if room \
                else engine_order(executed, held_keys)  # rows_for: hits, then misses, sorted
        for e in order:
            key = base + e
            if e in in_slots:
                load = in_slots[e]
                if load is None:
                    self.hits += 1
                    yield from self.cache_hit(key)
                    continue
            elif policy.app_cache and lru.lookup(key, (step, layer)):
                load = lru.get(key)
                if load is None:
                    yield from self.cache_hit(key)
                if policy.slots:
                    slots.place(layer, e, load, keep)
            else:
                if room:
                    lru.make_room(room, (step, layer), call)
                    room = 0
                load = yield from self.new_load(step, layer, e, key, self.bundle_bytes,
                                                self.sc.demand_pieces, DEMAND, hold=True)
                if not load.done.triggered:
                    held.append(load)
                if policy.app_cache:
                    lru.insert(key, (step, layer), load, keep=call)
                if policy.slots:
                    slots.place(layer, e, load, keep)
            if load is None:
                self.hits += 1
                continue
            need.append(load)
            if load.step == step and load.source in (DEMAND, PREFETCH):
                self.misses += 1
            else:
                self.hits += 1
        if held:
            self._hand_out(held)
        return executed, need

    def _fill_stack(self, rows: int) -> Generator:
        """The exact path's stack for this call's `rows` distinct experts: zeroed by MLX on its
        stream and evaluated before the reads land in it (engine.paths.exact.fetch). The main
        thread waits for it; the engine's recorder counts the wait as graph building."""
        self.compute.submit(rows * self.stack_fill_s, lazy=False)
        self.build += yield from self._wait_for_compute()

    # -- steps ------------------------------------------------------------------------------
    def decode(self, step: int, request: int, row: int, phase: str = "decode") -> Generator:
        """Decode step `step` (trace step index) executing routing row `row`, synchronous loop
        (`phase`: what the step is recorded as; a one-token prefill runs this path too)."""
        start = self.env.now
        self.begin_step()
        yield from self.stage_boundary(step, row)
        for layer in range(self.layers):
            yield from self.cpu(self._layer_build_s(layer))
            self._queue_attention(layer)
            yield from self._execute_layer(step, row, layer, self.cpu)
            self.compute.submit(self.expert_s)
        if self.unembed_s:
            self.compute.submit(self.unembed_s)
        yield from self.gpu_sync()
        self.record_step(step, request, phase, 1, start)

    def decode_lookahead(self, step: int, request: int, row: int, built: bool,
                         next_row: int | None) -> Generator:
        """Decode step `step` (routing row `row`) in the lookahead loop: its window, during which
        step+1 (routing row `next_row`; None when the request ends here) is built. `built`: the
        step's graph was built, and its begin (`begin`) done, in the previous window.
        Approximation: the engine builds a request's first decode step in the window of its last
        prefill token, which the sim's whole-layer prefill does not model; here that step builds
        its own graph at the start of its window (L x build once per request)."""
        start = self.env.now
        self.begin_step()
        if not built:  # the first decode step of a request: build it, then begin it
            for layer in range(self.layers):
                yield from self.cpu(self._layer_build_s(layer))
            yield from self.begin(step, row, queue_first=True)
        if built and self.sc.token_host_ms:  # the previous token's record (engine.recorder)
            yield from self.fill_cpu(self.sc.token_host_ms / 1e3, "other")
        for layer in range(self.layers):
            if next_row is not None:  # step+1's layer, while this step computes
                yield from self.cpu(self._layer_build_s(layer))
            if self.unresolved:  # one fill point a built layer (engine.fill_points.progress)
                yield from self._resolve(step, row, self.unresolved.pop(0))
        while self.unresolved:  # drain
            yield from self._resolve(step, row, self.unresolved.pop(0))
        yield from self.gpu_sync()  # token `step` on the host
        if next_row is not None:
            yield from self.begin(step + 1, next_row)
        self.record_step(step, request, "decode", 1, start)

    def begin(self, step: int, row: int, queue_first: bool = False) -> Generator:
        """begin(step) (engine.fill_points.begin, from engine.generate.finish): step's first
        router is queued; its predicted ids come to the host in one sync (the heads that
        computed them are a side output of the previous step's final evaluation, queued with
        its token, so they are on the host about when the token is: reports/io/token-lead) and
        their reads start, the first layer's hint before them. With a token lead (layer 0
        routed, every later layer predicted) the routed head is the step's only wait on its
        own compute and is resolved here: its router synced and its reads issued, then the
        predicted layers' reads, then its reads waited for and its experts queued, then the
        first predicted layer's. `self.unresolved`: the layers left to the next window's build (one
        resolved a built layer, the rest drained). `queue_first`: the first router is queued
        before the reads start (a request's first decode step, built in its own window);
        else after, at the end of the previous step's window, where the in-order stream
        runs it after that step's token either way."""
        self.unresolved = list(range(self.layers))
        if not self.head_at_begin:
            if queue_first:
                yield from self.queue_attention_async(0)
            yield from self.hint(step, row)  # the first layer's, before the rest
            yield from self.stage_boundary(step, row)
            if not queue_first:
                yield from self.queue_attention_async(0)
            return
        yield from self.queue_attention_async(0)  # the walk to the routed head's router
        yield from self.hint(step, row)
        routed = yield from self._route(step, row, 0)  # its reads first
        yield from self.stage_boundary(step, row)
        yield from self._resolve(step, row, self.unresolved.pop(0), routed)
        if self.unresolved:
            yield from self._resolve(step, row, self.unresolved.pop(0))

    def _resolve(self, step: int, row: int, layer: int,
                 routed: tuple[list[int], list[Load]] | None = None) -> Generator:
        """Fill point `layer` of `step` (engine.fill_points._resolve_head): its experts in place
        (a routed layer syncs on its router), then its gather handed over, then the walk on to
        the next routed layer's router (a predicted layer's attention goes with its own
        gather), each prepared and dispatched on this thread first; after the last layer, the
        unembedding. `routed`: a routed layer's `_route`, done earlier (its loads issued)."""
        yield from self._execute_layer(step, row, layer, self.fill_cpu, routed)
        yield from self.dispatch(self.dispatch_s)
        dispatched = self.dispatch_s  # the gather's and the walk's: one dispatch charge
        # a predicted layer's attention was not walked to (only routers are; layer 0's was
        # queued by begin): it goes in one async_eval with the experts, which waits at its end
        if layer > 0 and self.policy.staged_layer(layer):
            yield from self.queue_attention_async(layer, dispatched=dispatched, ahead=math.inf)
            dispatched = 0.0
        yield from self.queue_async(self.expert_s, ahead=self.gather_ahead_s)
        nxt = layer + 1
        if nxt < self.layers and not self.policy.staged_layer(nxt):
            yield from self.queue_attention_async(nxt, dispatched=dispatched)
        elif nxt >= self.layers and self.unembed_s:
            yield from self.queue_async(self.unembed_s)

    def _execute_layer(self, step: int, row: int, layer: int,
                       charge: Callable[[float], Generator],
                       routed: tuple[list[int], list[Load]] | None = None) -> Generator:
        """Get `layer`'s executed experts in place (staged slots, or a sync on the router then
        the caches and demand loads), charge the slot rewrites to `charge` (graph building in
        the synchronous loop, fill work in the lookahead loop) and log the set. After a cold
        stall the compute thread's next work starts late by the scenario's
        `cold_fill_compute_ms` (fitted inside decode, per loop)."""
        cold = self.cold_waits
        if self.policy.staged_layer(layer):
            executed = yield from self._staged_layer(step, row, layer)
        else:
            executed = yield from self._router_layer(step, row, layer, routed)  # router sync
        if self.cold_waits > cold and self.sc.cold_fill_compute_ms > 0:
            self.compute.wake_after(self.sc.cold_fill_compute_ms / 1e3)
        if self.policy.slots and self.slot_update_s:
            last = self.slots.last_call[layer]
            yield from charge(self.slot_update_s * sum(1 for e in executed if e not in last))
        self.slots.settle(layer, frozenset(executed))
        self.executed_log.append(executed)

    def _layer_build_s(self, layer: int) -> float:
        return self.layer_build_s[layer]

    def _attention_s(self, layer: int) -> float:
        """`layer`'s attention (+ its head; + the swap-in of its resident pages when memory is
        oversubscribed)."""
        seconds = self.layer_attn_s[layer]
        if self.swap.swapped:
            seconds += self.swap.layer_fault_s(self.env.now)
        return seconds

    def _queue_attention(self, layer: int) -> None:
        self._owe_dispatch()
        self.compute.submit(self._attention_s(layer), wait=self.compute_wait_s)

    def queue_attention_async(self, layer: int, dispatched: float = 0.0,
                              ahead: float | None = None) -> Generator:
        """Hand `layer`'s attention over, async_eval, owing its operations' dispatch less
        `dispatched`: what the serial `dispatch` before it already charged for them (the
        lookahead loop's walk to the next router is dispatched once, by that async_eval).
        `ahead`: as queue_async's."""
        self.dispatch_owed += max(0.0, self.dispatch_cpu_s - dispatched)
        yield from self.queue_async(self._attention_s(layer), wait=self.compute_wait_s,
                                    ahead=ahead)

    def queue_async(self, seconds: float, wait: float = 0.0,
                    ahead: float | None = None) -> Generator:
        """Hand `seconds` to the compute stream as async_eval does (the lookahead loop): where
        the stream's queue is bounded the host waits until little is left queued, which is
        waiting on compute (eval time). `ahead`: the compute left when this hand-over returns
        (sim.compute_stream: a layer's experts leave more than a walk; inf: no wait, more is
        handed over in the same async_eval), else the hardware's queue_ahead_ms."""
        done = self.compute.submit_async(seconds, wait, ahead)
        start = self.env.now
        if done is not None:  # the host waits: what it owes of the dispatch runs meanwhile
            yield from self._dispatching(done)
        yield from self.gil.take_back()  # async_eval let go of it (sim.gil)
        self.eval += self.env.now - start

    def record_step(self, step: int, request: int, phase: str, tokens: int, start: float) -> None:
        # CPU since the previous row, as the engine's recorder counts it: every thread's work
        # handed to the cores (sim.cpu), the main thread's and the reader threads'
        busy = self.cores.busy_s
        spent = {t: s - self.thread_cpu_seen.get(t, 0.0) for t, s in busy.items()}
        self.thread_cpu_seen = dict(busy)
        readers = sum(s for t, s in spent.items() if t.startswith(READER_THREAD))
        parts, self.main_parts = self.main_parts, Counter()
        parts["other"] += spent.get(MAIN_THREAD, 0.0) - sum(parts.values())
        if phase == "decode":
            for thread, seconds in spent.items():
                if not thread.startswith(READER_THREAD):
                    self.decode_cpu_s[thread] += seconds
            self.decode_cpu_s["readers"] += readers
            self.decode_main_parts.update(parts)
        self.log.add(step=step, request=request, phase=phase, tokens=tokens, start=start,
                     end=self.env.now, build=self.build, eval=self.eval, blocked=self.blocked,
                     hits=self.hits, misses=self.misses,
                     evictions=self.lru.evictions + self.slots.evictions - self.evictions0,
                     lru_bytes=self.lru.used_bytes,
                     page_cache_bytes=self.fetcher.pc.used_bytes,
                     cpu=sum(spent.values()), main_cpu=spent.get(MAIN_THREAD, 0.0),
                     reader_cpu=readers)

    def prefill_step(self, step: int, request: int, tokens: int) -> Generator:
        """A prefill step: every layer's experts as one whole-layer load (the engine's
        whole-layer path), layer L+1's load issued as layer L's compute is queued so the two
        overlap. Compute is the larger of the tokens' FLOPs and the bytes the layer touches."""
        start = self.env.now
        self.begin_step()
        m = self.sc.model
        layer_bytes = self.experts * self.bundle_bytes
        # distinct experts a layer's tokens touch (expected, uniform routing)
        touched = self.experts * (1 - (1 - self.sc.k / self.experts) ** tokens)
        compute = max(tokens * 2 * m.active_params / m.layers / self.flops,
                      (m.resident_bytes / m.layers + touched * self.bundle_bytes) / self.mem_bw)

        def whole(layer: int) -> Generator:
            return self.new_load(step, layer, -1, -1, layer_bytes, m.whole_layer_reads,
                                 WHOLE_LAYER)

        upcoming = yield from whole(0)
        for layer in range(self.layers):
            yield from self.cpu(self.build_s)
            yield from self.wait(upcoming)
            self.compute.submit(compute + self.swap.layer_fault_s(self.env.now))
            if layer + 1 < self.layers:
                upcoming = yield from whole(layer + 1)  # overlaps this layer's compute
        yield from self.gpu_sync()
        self.record_step(step, request, "prefill", tokens, start)

    def run(self, plan: list[tuple[str, int, int, int]]) -> Generator:
        """plan: (phase, tokens, request, routing row) per step, in order."""
        built = False  # lookahead: this decode step's graph was built in the previous window
        for step, (phase, tokens, request, row) in enumerate(plan):
            if phase == "prefill":
                yield from self.prefill_step(step, request, tokens)
                built = False
            elif phase == PREFILL_TOKEN:  # the decode path, synchronously, recorded as prefill
                yield from self.decode(step, request, row, phase="prefill")
                built = False
            elif self.lookahead:
                nxt = plan[step + 1] if step + 1 < len(plan) else None
                ahead = nxt is not None and nxt[0] == "decode" and nxt[2] == request
                next_row = nxt[3] if ahead else None
                yield from self.decode_lookahead(step, request, row, built, next_row)
                built = ahead
            else:
                yield from self.decode(step, request, row)
