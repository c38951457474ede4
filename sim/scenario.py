"""What a simulation runs: a hardware profile, a model profile and the engine/run settings.

Plain dataclasses; loading, validation and `--set key=value` overrides live in sim.profiles.
Units are in the field names: *_gib (2^30 bytes), *_bytes, *_gbps (10^9 bytes per second),
*_ms, *_tflops. Every profile value carries its source in the TOML file it came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from contract.engine_config import PATHS

GIB = 1 << 30
MIB = 1 << 20

# The engine's decode paths the simulator runs (contract.engine_config.PATHS; whole-layer is
# simulated at prefill only) and how far ahead a staged layer's routing is known (LEADS).
DECODE_PATHS = tuple(p for p in PATHS if p != "whole-layer")
# Scenario keys of simulator v1, renamed to the engine's vocabulary: key -> what to write.
RENAMED = {
    "policy": "the engine's names: path = exact | hot | staged and lead = none | token | layer "
              "(on-demand -> path staged, lead none; prerouter -> path staged, lead token; "
              "prerouter with lead N -> lead layer, lead_layers N)",
    "slot_headroom": "staged_headroom (staged slots per layer beyond K; -1 = K, as the engine)",
    **{k: "routing_k, routing_reuse, routing_skew, routing_recall, routing_recall_window "
       "(per captured K; refit with `ssdmoe sim profile-model --trace`)"
       for k in ("routing_reuse_at_k0", "routing_reuse_per_expert_share", "routing_skew_at_k0",
                 "routing_skew_per_k")},
}


@dataclass
class Hardware:
    name: str
    ram_gib: float  # physical memory
    os_reserve_gib: float  # what the OS and other processes keep: never page cache for us
    ssd_bandwidth_gbps: float  # device transfer rate, shared by all requests in flight
    ssd_latency_ms: float  # fixed device time per request (overlaps across the queue depth)
    queue_depth: int  # requests the device serves at once
    load_overhead_ms: float  # CPU per load on the thread doing it (syscall, array, bookkeeping)
    cold_overhead_ms: float  # extra CPU per cold load (page faults, VM mapping), beyond the device
    memcpy_gbps: float  # page-cache -> app copy rate; 0 means free (folded into load_overhead_ms)
    readahead: bool  # a cold read brings the whole bundle in (later pieces of it are warm)
    cpu_factor: float  # graph-build time = model build_ms_per_layer x this
    mem_bandwidth_gbps: float  # accelerator memory bandwidth: decode compute roofline
    compute_tflops: float  # accelerator throughput: prefill compute roofline
    slot_update_ms: float  # in-place rewrite of one staged slot (incr_stack), main thread
    description: str = ""
    # Optional (measured by `ssdmoe calibrate`; the defaults keep the plain roofline model):
    expert_gbps: float = 0.0  # rate the expert kernel consumes bundle bytes; 0 = mem_bandwidth
    expert_overhead_ms: float = 0.0  # fixed accelerator time of one layer's expert computation
    sync_overhead_ms: float = 0.0  # extra accelerator time per host sync that finds work queued
    lazy_compute: bool = False  # in the synchronous decode loop and prefill, queued work runs
    # only when the main thread syncs (MLX evaluates lazily and those loops have no async eval):
    # graph building never overlaps compute. The lookahead loop (Scenario.lookahead) is never lazy
    throttle_read_mbps: float = 0.0  # block-I/O read throttle in MB/s (10^6); 0 = none
    throttle_read_iops: float = 0.0  # read requests/s throttle; 0 = none
    throttle_burst_s: float = 0.1  # blk-throttle's slice, or the token bucket's burst (s)
    page_cache_policy: str = "lru"  # which bundles the OS page cache keeps: "lru", or
    # "linux-two-list" (Linux's active/inactive lists with workingset detection,
    # sim.two_list_lru). An engine page-cache budget drops by recency itself: lru (sim compare)
    throttle_kind: str = "blk-throttle"  # the kernel's throttle (engine.throttle), or
    # "token-bucket" (a cloud disk's burst credits): sim.throttle
    handoff_ms: float = 0.0  # thread hand-off the main thread pays per load it waits on that a
    # reader thread performs (the event set, the main thread's wake-up and the GIL)
    gil_handoff_ms: float = 0.0  # a thread that slept on the GIL runs this long after the holder
    # lets go (its wake-up; sim.gil), when the scenario models the GIL
    cold_read_cpu_ms: float = 0.0  # a cold bundle read's CPU on the reading thread (its
    # kernel work: submitting and completing the requests, pages, the copy); what the load's
    # modelled CPU leaves out runs beside its device time (sim.loads). 0 = not measured
    cold_read_cpu_us_per_page: float = 0.0  # a cold read's CPU per 4 KiB page it brings in
    # (page allocation, page-cache insertion, the copy); with it, cold_read_cpu_ms is the
    # per-request part and a cold read costs that + pages x this. 0 = the per-bundle figure
    # alone, scaled by bytes
    reader_wake_ms: float = 0.0  # a reader thread idle on the queue starts the load handed to
    # it this late (its wake-up, a core, the GIL): sim.readers
    compute_factor: float = 1.0  # accelerator time inside decode / as the roofline figures above
    # give it (fitted by `ssdmoe validate` from its calibration configurations; 1 = as measured)
    cpu_cores: float = 0.0  # host cores shared by graph building, readers' copies and faults and
    # (compute_on_cpu) the compute thread (sim.cpu); 0 = not modelled: no thread waits for a core
    compute_on_cpu: bool = False  # the accelerator is the host CPU (MLX's CPU backend): compute
    # work takes a core like any other thread
    background_cores: float = 0.0  # cores other processes keep busy (a shared machine)
    reader_cpu_weight: float = 1.0  # a reader thread's weight on the shared cores against the
    # other threads' 1 (sim.cpu): the kernel serves a thread waking for a short burst first
    # (calibration.sched_probe); 1 = plain processor sharing
    core_wait_ms: float = 0.0  # a thread back from the device that finds every core busy waits
    # this long for one (calibration.core_wait_probe; sim.cpu); 0 = never
    page_cache_floor_gib: float = 0.0  # file pages the kernel keeps before it pages out the
    # engine's own memory (sim.swap); below it an oversubscribed engine faults
    queue_speedup: list[float] = field(default_factory=list)  # device request rate with n
    # reads in flight over one's, n = 1, 2, ... (sim.shared_device); empty: queue_depth slots
    refused_warm_ms: float = 0.0  # main-thread cost of asking whether a demand miss is wholly
    # in the page cache and being refused (engine.readers: small bundles, help_reads)
    stall_points_ms: list[float] = field(default_factory=list)  # a fill's blocked time at
    # which the waits below were measured in the lookahead decode loop (sim.stall_wake; empty:
    # not modelled)
    stall_wake_main_ms: list[float] = field(default_factory=list)  # the main thread's wait for
    # a core after that stall, before it runs again (calibration.stall_probe)
    stall_wake_compute_ms: list[float] = field(default_factory=list)  # the compute thread's,
    # idle through the stall, before it runs the next work it is handed
    busy_stall_points_ms: list[float] = field(default_factory=list)  # a fill's blocked time
    # with the host kept busy (the reading thread's CPU, not a sleep) at which the growth below
    # was measured in the lookahead loop (calibration.stall_probe's busy hold; empty: none)
    busy_stall_compute_ms: list[float] = field(default_factory=list)  # eval grown per such
    # fill: the compute thread's next work runs late or slow, not waiting for a core
    sync_stall_points_ms: list[float] = field(default_factory=list)  # the same curve measured
    sync_stall_wake_main_ms: list[float] = field(default_factory=list)  # in the synchronous
    sync_stall_wake_compute_ms: list[float] = field(default_factory=list)  # loop (empty: none)
    idle_util_points: list[float] = field(default_factory=list)  # the share of recent time
    # any of the process's threads ran (0-1, the kernel's 32 ms average) at which the slowdown
    # below was measured (sim.idle_slowdown; empty: not modelled)
    idle_slowdown: list[float] = field(default_factory=list)  # extra CPU time per CPU second
    # of work started at that share (calibration.idle_probe), in the lookahead decode loop
    sync_idle_util_points: list[float] = field(default_factory=list)  # the same curve in the
    sync_idle_slowdown: list[float] = field(default_factory=list)  # synchronous loop
    queue_ahead_ms: float = math.inf  # compute left queued when a non-blocking eval returns
    # (sim.compute_stream's bounded queue: MLX blocks while > 10 tasks are in flight, one
    # operation each on its CPU backend); inf = the host never waits (Metal command buffers)


@dataclass
class ModelProfile:
    name: str
    layers: int
    experts: int
    k: int  # the model's native top-K (a scenario may run another K)
    bundle_bytes: int  # one expert's slices of its layer's tensors
    resident_bytes: int  # non-expert weights, always in memory and read every token
    active_params: float  # parameters touched per token (prefill FLOPs = 2 x this per token)
    kv_bytes_per_token: int
    consumer_first: int  # layers consumer_first..consumer_last stream by prediction
    consumer_last: int  # (-1, -1) when the model has no heads; owners are consumers - 1
    heads: int  # prediction heads evaluated per step (may own one past the last consumer)
    head_bytes: int  # weights of one head
    build_ms_per_layer: float  # CPU graph building per decoder layer on the reference CPU
    head_build_ms: float  # CPU graph building per head
    whole_layer_reads: int = 9  # reads per whole-layer load at prefill (bundled layout: one
    # vectored read per IOV_MAX iovecs; stacked: one per tensor)
    bundle_reads: int = 1  # device requests of a cold bundle read without readahead: one per
    # range (bundled layout: one contiguous range, one read; stacked: one pread per slice)
    device_bundle_bytes: int = 0  # bytes a cold bundle read moves from the device: its ranges
    # rounded out to whole pages, as the kernel reads them (0: bundle_bytes)
    shared_page_reads: int = 0  # of bundle_reads, the slices smaller than a page that share it
    # with the same slice of the other experts of their page group: no device request while
    # that page is cached (sim.page_cache)
    page_group: int = 1  # experts a shared page holds (expert e's group: e // page_group)
    # routing statistics fitted to traces (sim.routing_fit, `sim profile-model --trace`), one
    # entry per K the model was captured at; synthetic routing at another K interpolates
    # linearly between them (the nearest outside), when a scenario says routing_stats = "model"
    routing_k: list[int] = field(default_factory=list)  # empty: not fitted
    routing_reuse: list[float] = field(default_factory=list)  # adjacent-token reuse
    routing_skew: list[float] = field(default_factory=list)  # Zipf popularity
    routing_recall: list[float] = field(default_factory=list)  # multi-token reuse
    routing_recall_window: list[int] = field(default_factory=list)  # ... tokens back
    unembed_bytes: int = 0  # the output projection's share of resident_bytes, read once per
    # step after the last layer (0: spread over the layers with the rest)
    lora_bytes: int = 0  # the recovery LoRA's weights (engine.lora), held and read every token
    # beside each layer's attention when a scenario serves it (Scenario.lora)
    lora_build_ms: float = 0.0  # CPU graph building the adapter adds per decoder layer
    fill_ms_per_layer: float = 0.0  # the lookahead decode loop's main-thread work at each
    # layer's fill point that compute waits on: handing the gather and the walk to the next
    # router over (mx.async_eval: MLX prepares and dispatches each operation on the calling
    # thread; on a CPU backend the queue is nearly empty then) and the fill's host work; not
    # in the synchronous loop, whose measured compute already holds its dispatch
    # (sim.main_thread.dispatch)
    description: str = ""

    def is_consumer(self, layer: int) -> bool:
        return self.consumer_first <= layer <= self.consumer_last

    @property
    def consumer_count(self) -> int:
        if self.consumer_first < 0:
            return 0
        return self.consumer_last - self.consumer_first + 1

    @property
    def expert_bytes(self) -> int:
        return self.layers * self.experts * self.bundle_bytes


@dataclass
class Scenario:
    name: str
    hardware: Hardware
    model: ModelProfile
    path: str = "staged"  # the engine's decode path: exact | hot | staged (sim.policies)
    k: int = 0  # experts per token; 0 = the model's native K
    lead: str = "none"  # staged path: none (the router, on demand) | token (prediction heads,
    # one token ahead, one flush per step) | layer (same token, lead_layers ahead)
    lead_layers: int = 1  # lead "layer": how many layers ahead (the engine's layer lead: 1)
    decode_steps: int = 200
    prefill_tokens: int = 0  # 0 = no prefill step
    context_tokens: int = 0  # KV cache already held (memory only)
    lru_bytes: int = 0  # bundle LRU shared by all layers: the hot path's budget; behind the
    # staged path's slots, the paper's engine's bundle LRU (ours has none: 0); exact: none
    readers: int = 0  # reader threads; 0 = every load runs synchronously on the main thread
    demand_pieces: int = 1  # reads per bundle on the demand path (tensor-wise partial reads)
    prefetch_pieces: int = 1  # reads per bundle on the prefetch path
    prediction_is_routing: bool = True  # prerouter: the predicted set is executed (no fallback)
    prediction_accuracy: float = 1.0  # fraction of routed experts predicted (when not in trace)
    o_direct: bool = False  # bypass the page cache: every read is cold
    stager_dup_views: bool = False  # stager keeps bundle and stacked views (paper: ~0.45 GiB @K=8)
    staged_headroom: int = -1  # staged slots per layer = K + this; -1 = K (EngineConfig's
    # default: room to stage the next call's set while the last call's is in use)
    cold_fill_compute_ms: float = 0.0  # the compute thread's next work runs this much later after
    # a fill that waited on a cold load (fitted inside decode by ssdmoe validate per decode loop,
    # notes cold_fill_compute_ms.in_decode and .sync; 0 = nothing beyond sim.stall_wake's curves)
    budget_evict_ms: float = 0.0  # CPU per bundle the engine's page-cache budget drops (fadvise
    # DONTNEED on its ranges, engine.store), on the reading thread after its read: only where the
    # page cache is the engine's emulated budget (sim compare); 0 for a real OS page cache
    read_hold_ms: float = 0.0  # a wait inside every expert read, no CPU and the GIL let go
    # (calibration.stall_probe's arms sleep this long in each read: its replays)
    read_hold_busy: bool = False  # the hold is CPU on the reading thread's core instead, the
    # GIL let go (the stall probe's busy hold: reports/validation/busy_stall_probe.py)
    gil: bool = False  # the engine's threads share Python's interpreter lock (sim.gil): graph
    # building and fill work on the main thread, each load's Python bookkeeping on its reader
    help_reads: bool = True  # the main thread does a needed read no reader has started yet, and
    # of a fill point's misses reads the first itself (EngineConfig.help_reads, engine.readers)
    lookahead: bool = False  # decode loop of our engine's staged path (engine.generate): step
    # t+1's graph is built while step t computes, step t's work runs as soon as queued and each
    # layer's fill (router sync, loads) is done as that layer of step t+1 is built. False: the
    # synchronous loop (the paper's engine; ours on the exact and hot paths). sim.main_thread
    lora: bool = False  # serve the model's recovery LoRA, unmerged (its bytes and build time
    # from the model profile: lora_bytes, lora_build_ms)
    runtime_gib: float = 0.0  # other unreclaimable engine memory (activations, allocator slack)
    routing_stats: str = "scenario"  # synthetic routing from overlap/skew below ("scenario"),
    # or from the model profile's statistics fitted to traces, at this scenario's K ("model")
    overlap: float = 0.25  # synthetic routing: adjacent-token expert reuse
    skew: float = 0.0  # synthetic routing: per-layer expert popularity skew
    recall: float = 0.0  # synthetic routing: share of fresh draws copied from recent tokens
    recall_window: int = 16  # ... from the sets of this many last tokens
    seed: int = 0
    source: str = ""  # file the scenario came from (for error messages and run.json)
    notes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.k == 0:
            self.k = self.model.k

    @property
    def headroom(self) -> int:
        return self.k if self.staged_headroom < 0 else self.staged_headroom

    @property
    def staged_slots(self) -> int:
        """Slots per layer of the staged path's slot table (0 on the other paths)."""
        return self.k + self.headroom if self.path == "staged" else 0

    def arm(self) -> str:
        """The engine arm in its own words: path, lead, readers."""
        lead = {"none": "", "token": ", lead token",
                "layer": f", lead {self.lead_layers} layer(s)"}[self.lead]
        return f"path {self.path}{lead}, readers {self.readers}"

    @property
    def predicts(self) -> bool:
        """Staged routing known ahead: prediction heads (lead token) or the layer lead."""
        return self.path == "staged" and self.lead != "none"


SCENARIO_KEYS = tuple(
    f.name for f in fields(Scenario) if f.name not in ("name", "hardware", "model", "source",
                                                        "notes")
)
HARDWARE_KEYS = tuple(f.name for f in fields(Hardware) if f.name not in ("name", "description"))
HARDWARE_OPTIONAL = ("expert_gbps", "expert_overhead_ms", "sync_overhead_ms", "lazy_compute",
                     "handoff_ms", "gil_handoff_ms", "cold_read_cpu_ms",
                     "cold_read_cpu_us_per_page", "reader_wake_ms",
                     "throttle_read_mbps", "throttle_read_iops", "throttle_burst_s",
                     "throttle_kind", "page_cache_policy", "compute_factor", "cpu_cores",
                     "compute_on_cpu",
                     "background_cores", "reader_cpu_weight", "core_wait_ms",
                     "page_cache_floor_gib", "queue_ahead_ms", "queue_speedup",
                     "refused_warm_ms", "stall_points_ms", "stall_wake_main_ms",
                     "stall_wake_compute_ms", "busy_stall_points_ms", "busy_stall_compute_ms",
                     "sync_stall_points_ms", "sync_stall_wake_main_ms",
                     "sync_stall_wake_compute_ms", "idle_util_points", "idle_slowdown",
                     "sync_idle_util_points", "sync_idle_slowdown")
MODEL_KEYS = tuple(f.name for f in fields(ModelProfile) if f.name not in ("name", "description"))
