"""What a simulation runs: a hardware profile, a model profile and the engine/run settings.

Plain dataclasses; loading, validation and `--set key=value` overrides live in sim.profiles.
Units are in the field names: *_gib (2^30 bytes), *_bytes, *_gbps (10^9 bytes per second),
*_ms, *_tflops. Every profile value carries its source in the TOML file it came from.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

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

# Corrections for one VM's scheduler and device, retired after a held-out comparison
# (reports/transfer/retired.md): an older profile that still has them loads, and
# they are ignored.
RETIRED = frozenset({
    "reader_cpu_weight", "core_wait_ms", "queue_speedup",
    "stall_points_ms", "stall_wake_main_ms", "stall_wake_compute_ms", "busy_stall_points_ms",
    "busy_stall_compute_ms", "sync_stall_points_ms", "sync_stall_wake_main_ms",
    "sync_stall_wake_compute_ms", "idle_util_points", "idle_slowdown", "sync_idle_util_points",
    "sync_idle_slowdown"})


def key(default: Any = MISSING, *, help: str, obtain: str = "") -> Any:
    """A profile or scenario key: its default and what docs/simulator.md says of it (what it
    means, and how to obtain it; the unit is in the name). A list or dict default is copied
    per instance."""
    meta = {"help": help, "obtain": obtain}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    if default is MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Hardware:
    name: str
    ram_gib: float = key(
        help="physical memory",
        obtain="the machine's RAM (calibrate reads it; a spec sheet for another machine)")
    os_reserve_gib: float = key(
        help="what the OS and other processes keep: never page cache for us",
        obtain=("RAM minus what is available to processes (calibrate reads it from the OS; for "
                "another machine, its OS's footprint)"))
    ssd_bandwidth_gbps: float = key(
        help="device transfer rate, shared by all requests in flight",
        obtain=("measured by `ssdmoe calibrate` (O_DIRECT sequential reads); a spec sheet or a "
                "benchmark for another device"))
    ssd_latency_ms: float = key(
        help="fixed device time per request (overlaps across the queue depth)",
        obtain="measured by `ssdmoe calibrate` (O_DIRECT 4 KiB reads at queue depth 1)")
    queue_depth: int = key(
        help="requests the device serves at once",
        obtain="measured by `ssdmoe calibrate` (throughput against reads in flight)")
    load_overhead_ms: float = key(
        help="CPU per load on the thread doing it (syscall, array, bookkeeping)",
        obtain="measured by `ssdmoe calibrate` (the engine's store reading a warm bundle)")
    cold_overhead_ms: float = key(
        help="extra CPU per cold load (page faults, VM mapping), beyond the device",
        obtain=("measured by `ssdmoe calibrate` (cold against warm reads, beyond the device "
                "time)"))
    memcpy_gbps: float = key(
        help="page-cache -> app copy rate; 0 means free (folded into load_overhead_ms)",
        obtain="measured by `ssdmoe calibrate` (warm reads against size)")
    readahead: bool = key(
        help="a cold read brings the whole bundle in (later pieces of it are warm)",
        obtain="the engine reads with POSIX_FADV_RANDOM: false on every machine it runs on")
    cpu_factor: float = key(
        help="graph-build time = model build_ms_per_layer x this",
        obtain=("measured by `ssdmoe calibrate` (graph building against the model profile's "
                "reference)"))
    mem_bandwidth_gbps: float = key(
        help="accelerator memory bandwidth: decode compute roofline",
        obtain=("measured by `ssdmoe calibrate` (a decode step with the experts removed; on a "
                "CPU backend the compute thread's CPU time plus its waits for dispatch, "
                "compute_wait_ms_per_layer); a spec sheet for an accelerator"))
    compute_tflops: float = key(
        help="accelerator throughput: prefill compute roofline",
        obtain="measured by `ssdmoe calibrate`; a spec sheet for an accelerator")
    slot_update_ms: float = key(
        help="in-place rewrite of one staged slot (incr_stack), main thread",
        obtain="measured by `ssdmoe calibrate` (the staged path's slot rewrite)")
    description: str = ""
    # Optional (measured by `ssdmoe calibrate`; the defaults keep the plain roofline model):
    expert_gbps: float = key(0.0,
        help="rate the expert kernel consumes bundle bytes; 0 = mem_bandwidth",
        obtain=("measured by `ssdmoe calibrate` (the expert kernel's rate on bundle bytes; on "
                "a CPU backend, of the compute thread's CPU time)"))
    expert_size_bytes: list[float] = key([],
        help=("bundle sizes (bytes, ascending) at which the expert kernel's rate was measured "
              "(expert_size_gbps holds the rates): a wide model's weights outgrow the CPU's "
              "caches and its kernel runs slower per byte than a small one's (sim.expert_kernel: "
              "expert_gbps x the curve's rate at the model's bundle_bytes / its rate at its "
              "first size, the calibration model's); [] = expert_gbps at every size"),
        obtain=("measured by `ssdmoe calibrate` (calibration.expert_size_probe: synthetic "
                "experts shaped like the calibration model's, the intermediate size scaled)"))
    expert_size_gbps: list[float] = key([],
        help="the expert kernel's rate (GB/s of bundle bytes) at each expert_size_bytes",
        obtain="measured by `ssdmoe calibrate` with expert_size_bytes")
    expert_overhead_ms: float = key(0.0,
        help="fixed accelerator time of one layer's expert computation",
        obtain=("measured by `ssdmoe calibrate` (the expert kernel's fixed time; on a CPU "
                "backend, of the compute thread's CPU time)"))
    sync_overhead_ms: float = key(0.0,
        help="extra accelerator time per host sync that finds work queued",
        obtain="measured by `ssdmoe calibrate` (a host sync with work queued)")
    lazy_compute: bool = key(False,
        help=("in the synchronous decode loop and prefill, queued work runs only when the main "
              "thread syncs (MLX evaluates lazily and those loops have no async eval): graph "
              "building never overlaps compute. The lookahead loop (Scenario.lookahead) is never "
              "lazy"),
        obtain="true for MLX (lazy evaluation); calibrate writes it")
    throttle_read_mbps: float = key(0.0,
        help="block-I/O read throttle in MB/s (10^6); 0 = none",
        obtain="the emulated machine's --read-mbps, or a cloud disk's rate")
    throttle_read_iops: float = key(0.0,
        help="read requests/s throttle; 0 = none",
        obtain="the emulated machine's --read-iops, or a cloud disk's rate")
    throttle_burst_s: float = key(0.1,
        help="blk-throttle's slice, or the token bucket's burst (s)",
        obtain="the kernel's blk-throttle slice (0.1 s), or a cloud disk's burst")
    page_cache_policy: str = key("lru",
        help=("which bundles the OS page cache keeps: 'lru', or 'linux-two-list' (Linux's "
              "active/inactive lists with workingset detection, sim.two_list_lru). An engine "
              "page-cache budget drops by recency itself: lru (sim compare)"),
        obtain=("measured by `ssdmoe calibrate` (Linux without multi-generational LRU: "
                "linux-two-list; else lru)"))
    throttle_kind: str = key("blk-throttle",
        help=("the kernel's throttle (engine.throttle), or 'token-bucket' (a cloud disk's burst "
              "credits): sim.token_bucket"),
        obtain="blk-throttle for the kernel's throttle; token-bucket for a cloud disk")
    handoff_ms: float = key(0.0,
        help=("thread hand-off the main thread pays per load it waits on that a reader thread "
              "performs (the event set, the main thread's wake-up and the GIL)"),
        obtain=("measured by `ssdmoe calibrate` (a reader's load waited on against the same load "
                "inline); refit inside decode by `ssdmoe validate`"))
    gil_handoff_ms: float = key(0.0,
        help=("a thread that slept on the GIL runs this long after the holder lets go (its "
              "wake-up; sim.gil), when the scenario models the GIL"),
        obtain=("measured by `ssdmoe calibrate` (a thread's wake-up after the GIL holder lets "
                "go)"))
    cold_read_cpu_ms: float = key(0.0,
        help=("a cold bundle read's CPU on the reading thread (its kernel work: submitting and "
              "completing the requests, pages, the copy); what the load's modelled CPU leaves "
              "out runs beside its device time (sim.loads). 0 = not measured"),
        obtain="measured by `ssdmoe calibrate` (the reading thread's CPU per cold read)")
    cold_read_cpu_us_per_page: float = key(0.0,
        help=("a cold read's CPU per 4 KiB page it brings in (page allocation, page-cache "
              "insertion, the copy); with it, cold_read_cpu_ms is the per-request part and a "
              "cold read costs that + pages x this. 0 = the per-bundle figure alone, scaled by "
              "bytes"),
        obtain="measured by `ssdmoe calibrate` (cold reads' CPU against pages)")
    reader_wake_ms: float = key(0.0,
        help=("a reader thread idle on the queue starts the load handed to it this late (its "
              "wake-up, a core, the GIL): sim.reader_threads"),
        obtain="measured by `ssdmoe calibrate`; refit inside decode by `ssdmoe validate`")
    compute_factor: float = key(1.0,
        help=("accelerator time inside decode / as the roofline figures above give it (fitted by "
              "`ssdmoe validate` from its calibration configurations; 1 = as measured): it "
              "scales the non-expert compute and the expert kernel's fixed time, not the "
              "kernel's time per byte, which is measured at each bundle size "
              "(expert_size_gbps)"),
        obtain=("fitted by `ssdmoe validate` on its calibration configurations (1: as "
                "calibrated)"))
    cpu_cores: float = key(0.0,
        help=("host cores shared by graph building, readers' copies and faults and "
              "(compute_on_cpu) the compute thread (sim.cpu); 0 = not modelled: no thread waits "
              "for a core"),
        obtain=("the machine's cores (calibrate reads them; an emulated machine's --cpus or "
                "--cpu-quota)"))
    thread_cores: float = key(0.0,
        help=("cores the engine's threads may run on (a cpuset's size), where cpu_cores is the "
              "CPU time they get (a CFS quota spreads less time over the same cores); 0 = "
              "cpu_cores. Below 2 the main thread and the compute thread share one core "
              "(cross_core_op_us)"),
        obtain=("0 in a machine's own profile (its threads may use every core); `sim compare` "
                "sets it from a trace's cpuset (a quota keeps the machine's cores)"))
    cross_core_op_us: float = key(0.0,
        help=("wall time each MLX operation handed to the compute thread (compute_on_cpu) "
              "costs more when that thread and the main thread run on different cores than on "
              "one (MLX's task queue and the compute thread's sleeps and wake-ups across "
              "cores), us. The compute figures are measured with the threads on separate "
              "cores, so where they share one (thread_cores < 2) each layer's compute takes "
              "the model's primitives_per_layer x this less; 0 = not charged"),
        obtain=("measured by `ssdmoe calibrate` (calibration.handover_probe: chains of small "
                "operations handed over in pieces as a decode step does, on every core and "
                "pinned to one; the wall time's difference per primitive, counted from the "
                "graph); 0 where calibrate runs on one core or on an accelerator"))
    cross_core_op_main_us: float = key(0.0,
        help=("of the hand-over's extra across cores, the main thread's CPU per operation "
              "(inside mx.async_eval), us: where the threads share one core, the lookahead "
              "loop's dispatch at each fill point (the model's fill_ms_per_layer, measured on "
              "separate cores) takes primitives_per_layer x this less; 0 = not charged"),
        obtain=("measured by `ssdmoe calibrate` with cross_core_op_us (the main thread's CPU "
                "time per primitive, on every core less pinned to one)"))
    compute_on_cpu: bool = key(False,
        help=("the accelerator is the host CPU (MLX's CPU backend): compute work takes a core "
              "like any other thread"),
        obtain="true where MLX computes on the CPU (calibrate reads the backend)")
    background_cores: float = key(0.0,
        help="cores other processes keep busy (a shared machine)",
        obtain="cores other processes keep busy (a shared machine's load)")
    page_cache_floor_gib: float = key(0.0,
        help=("file pages the kernel keeps before it pages out the engine's own memory "
              "(sim.swap); below it an oversubscribed engine faults"),
        obtain=("the kernel's floor of file pages before it pages out anonymous memory (min_free "
                "and the watermarks on Linux)"))
    os_floor_gib: float = key(-1.0,
        help=("what the OS and other processes still hold under memory pressure, once the kernel "
              "has compressed or swapped their idle memory: below os_reserve_gib they give way "
              "after the page cache reaches its floor and before the engine's memory pages out "
              "(sim.memory_budget); -1 = they do not give way"),
        obtain=("-1 where other processes' memory cannot shrink (Linux without swap or zswap); on "
                "macOS (memory compressor) the least the OS and others were seen to hold under "
                "pressure"))
    fill_host_ms_per_load: float = key(0.0,
        help=("the main thread's host work a staged fill spends per expert it loads: placing it "
              "in a slot, planning and submitting its read, waiting for and collecting it "
              "(engine.paths.slot_table.SlotTable.place and settle), beside the read's own work "
              "on the thread that reads it; 0 = not charged"),
        obtain=("measured by `ssdmoe calibrate` (calibration.fill_probe: the main thread's CPU "
                "in them inside sampled decode, every read on the reader threads)"))
    refused_warm_ms: float = key(0.0,
        help=("main-thread cost of asking whether a demand miss is wholly in the page cache and "
              "being refused (engine.readers: small bundles, help_reads)"),
        obtain="measured by `ssdmoe calibrate` (an RWF_NOWAIT read refused)")
    page_drop_us_per_page: float = key(0.0,
        help=("CPU to drop one cached page from the page cache (POSIX_FADV_DONTNEED), us: the "
              "engine's emulated page-cache budget drops each evicted bundle's pages after a "
              "cold read (sim compare adds pages x this to budget_evict_ms); 0 = not charged"),
        obtain=("measured by `ssdmoe calibrate` (the slope of DONTNEED's time over the pages of "
                "cached ranges of a scratch file; Linux)"))
    reclaim_us_per_page: float = key(0.0,
        help=("CPU time a cold read takes more per page it brings in once the page cache is at "
              "a memory limit, us: the reading thread frees as many pages as it adds (direct "
              "reclaim: deactivating and scanning the LRU lists for victims, unmapping and "
              "freeing them), which costs more than dropping a known range; where a trace ran "
              "under a memory limit "
              "(direct_reclaim) a load pays its pages x this inside the read; 0 = "
              "page_drop_us_per_page stands in (profiles measured before this figure)"),
        obtain=("measured by `ssdmoe calibrate` (calibration.reclaim_probe: the reading "
                "thread's CPU time of cold reads of a scratch file inside a memory control group "
                "filled to its limit with active pages, against the same reads outside one; "
                "Linux, root)"))
    zero_fill_gbps: float = key(0.0,
        help=("rate at which MLX fills a fresh array with zeros on its stream (GB/s), its buffer "
              "still in the CPU's caches: the exact path allocates a zeroed stack for each "
              "call's distinct experts and evaluates it before reading into it "
              "(engine.paths.kernel.alloc_stack), so the main thread waits for rows x bundle "
              "bytes at this rate; with zero_fill_rotation_* the rate comes from there "
              "(sim.zero_fill); 0 = not charged"),
        obtain=("measured by `ssdmoe calibrate` (the zero-fill curve's first point: "
                "calibration.zero_fill_probe); a spec sheet's memory bandwidth on an "
                "accelerator"))
    zero_fill_rotation_mib: list[float] = key([],
        help=("the zero fill's rate against how much memory was touched since the stack's "
              "buffer was last used (MiB, ascending; zero_fill_rotation_gbps holds the rates): a "
              "buffer a step freed leaves the CPU's caches once a step touches more than they "
              "hold, and its fill then runs at memory's speed (sim.zero_fill interpolates at "
              "the bytes one decode step of the exact path touches); [] = zero_fill_gbps"),
        obtain=("measured by `ssdmoe calibrate` (calibration.zero_fill_probe: alloc_stack of a "
                "2 MiB stack with a rotation of live stacks of this many MiB, less a one-bundle "
                "call, per byte)"))
    zero_fill_rotation_gbps: list[float] = key([],
        help="the zero fill's rate (GB/s) at each zero_fill_rotation_mib",
        obtain="measured by `ssdmoe calibrate` with zero_fill_rotation_mib")
    queue_ahead_ms: float = key(math.inf,
        help=("compute left queued when a non-blocking eval returns (sim.compute_stream's "
              "bounded queue: MLX blocks while > 10 tasks are in flight, one operation each on "
              "its CPU backend); inf = the host never waits (Metal command buffers)"),
        obtain=("measured by `ssdmoe calibrate` (MLX's CPU backend blocks with ~10 tasks queued; "
                "inf on Metal)"))
    gather_queue_ahead_ms: float = key(-1.0,
        help=("compute left queued when a non-blocking eval of a layer's experts (its gather, "
              "the engine's fill points) returns: the same bound as queue_ahead_ms, ending in "
              "the experts' few large operations instead of a walk's many small ones; -1 = not "
              "measured, queue_ahead_ms stands in"),
        obtain=("measured by `ssdmoe calibrate` (calibration.compute_probes: a resident decode "
                "step's experts handed over with mx.async_eval after their router's sync)"))

    @property
    def threads_share_one_core(self) -> bool:
        """The main thread and the compute thread (compute_on_cpu) run on one core."""
        cores = self.thread_cores or self.cpu_cores
        return self.compute_on_cpu and 0 < cores < 2


@dataclass
class ModelProfile:
    name: str
    layers: int = key(
        help="decoder layers with routed experts",
        obtain="the manifest (`ssdmoe sim profile-model MODEL`)")
    experts: int = key(
        help="routed experts per layer",
        obtain="the manifest")
    k: int = key(
        help="the model's native top-K (a scenario may run another K)",
        obtain="the run's --top-k (0: the model's)")
    bundle_bytes: int = key(
        help="one expert's slices of its layer's tensors",
        obtain="the manifest")
    resident_bytes: int = key(
        help="non-expert weights, always in memory and read every token",
        obtain="the manifest")
    active_params: float = key(
        help="parameters touched per token (prefill FLOPs = 2 x this per token)",
        obtain="the manifest")
    kv_bytes_per_token: int = key(
        help="KV cache bytes one token adds",
        obtain="the model's config (layers, KV heads, head size)")
    consumer_first: int = key(
        help="layers consumer_first..consumer_last stream by prediction",
        obtain="the prerouter heads (prerouter.json)")
    consumer_last: int = key(
        help="(-1, -1) when the model has no heads; owners are consumers - 1",
        obtain="the prerouter heads (prerouter.json)")
    heads: int = key(
        help="prediction heads evaluated per step (may own one past the last consumer)",
        obtain="the prerouter heads (prerouter.json)")
    head_bytes: int = key(
        help="weights of one head",
        obtain="the prerouter heads' weights")
    build_ms_per_layer: float = key(
        help="CPU graph building per decoder layer on the reference CPU",
        obtain="measured by `ssdmoe calibrate` on the model (graph building per layer)")
    head_build_ms: float = key(
        help="CPU graph building per head",
        obtain="measured by `ssdmoe calibrate` on the model")
    head_read_bytes: int = key(0,
        help=("bytes one head's evaluation reads a step: its weights less the rows it only "
              "gathers (this engine's heads look their one-hot inputs up in a table: 2K of its "
              "2E rows a step, engine.prerouter.StackedHeads); 0 = head_bytes (a dense head "
              "reads all its weights). The heads' compute is these bytes at the attention's rate"),
        obtain="the prerouter heads (prerouter.json: dims, experts, hidden, top_k)")
    whole_layer_reads: int = key(9,
        help=("reads per whole-layer load at prefill (bundled layout: one vectored read per "
              "IOV_MAX iovecs; stacked: one per tensor)"),
        obtain="the manifest's layout (IOV_MAX iovecs per vectored read)")
    bundle_reads: int = key(1,
        help=("device requests of a cold bundle read without readahead: one per range (bundled "
              "layout: one contiguous range, one read; stacked: one pread per slice)"),
        obtain="the manifest's layout (bundled: 1)")
    device_bundle_bytes: int = key(0,
        help=("bytes a cold bundle read moves from the device: its ranges rounded out to whole "
              "pages, as the kernel reads them (0: bundle_bytes)"),
        obtain="the manifest's layout (ranges rounded to pages)")
    shared_page_reads: int = key(0,
        help=("of bundle_reads, the slices smaller than a page that share it with the same slice "
              "of the other experts of their page group: no device request while that page is "
              "cached (sim.page_cache)"),
        obtain="the manifest's layout (stacked slices smaller than a page)")
    page_group: int = key(1,
        help="experts a shared page holds (expert e's group: e // page_group)",
        obtain="the manifest's layout")
    routing_k: list[int] = key([],
        help=("the K of each entry of the routing statistics below, fitted to traces "
              "(sim.routing_fit, `sim profile-model --trace`), one entry per K the model was "
              "captured at; synthetic routing at another K interpolates linearly between them "
              "(the nearest outside), when a scenario says routing_stats = 'model'. Empty: not "
              "fitted"),
        obtain="captured traces (`ssdmoe sim profile-model --trace`)")
    routing_reuse: list[float] = key([],
        help="adjacent-token reuse",
        obtain="captured traces (sim.routing_fit)")
    routing_skew: list[float] = key([],
        help="Zipf popularity",
        obtain="captured traces (sim.routing_fit)")
    routing_recall: list[float] = key([],
        help="multi-token reuse",
        obtain="captured traces (sim.routing_fit)")
    routing_recall_window: list[int] = key([],
        help="... tokens back",
        obtain="captured traces (sim.routing_fit)")
    prerouted_routing_k: list[int] = key([],
        help=("the same statistics of the routing the prerouter's heads give (lead token: "
              "their predictions are the routing, with more reuse and skew than the model's "
              "own routers); synthetic routing of a token-lead scenario uses them when fitted. "
              "Empty: not fitted"),
        obtain="captured traces run with --prerouter (`ssdmoe sim profile-model --trace`)")
    prerouted_routing_reuse: list[float] = key([],
        help="adjacent-token reuse, prerouted",
        obtain="captured prerouted traces (sim.routing_fit)")
    prerouted_routing_skew: list[float] = key([],
        help="Zipf popularity, prerouted",
        obtain="captured prerouted traces (sim.routing_fit)")
    prerouted_routing_recall: list[float] = key([],
        help="multi-token reuse, prerouted",
        obtain="captured prerouted traces (sim.routing_fit)")
    prerouted_routing_recall_window: list[int] = key([],
        help="... tokens back, prerouted",
        obtain="captured prerouted traces (sim.routing_fit)")
    unembed_bytes: int = key(0,
        help=("the output projection's share of resident_bytes, read once per step after the "
              "last layer (0: spread over the layers with the rest)"),
        obtain="the manifest")
    lora_bytes: int = key(0,
        help=("the recovery LoRA's weights (engine.lora), held and read every token beside each "
              "layer's attention when a scenario serves it (Scenario.lora)"),
        obtain="the adapter's weights (lora/)")
    lora_build_ms: float = key(0.0,
        help="CPU graph building the adapter adds per decoder layer",
        obtain="measured by `ssdmoe calibrate` on the model with its adapter")
    primitives_per_layer: float = key(0.0,
        help=("MLX operations one decode layer hands to the compute thread (attention, router, "
              "experts, norms; the step's unembedding spread over its layers): what "
              "cross_core_op_us is charged on"),
        obtain=("counted by `ssdmoe calibrate` (the primitives of a resident decode step's "
                "graph, mx.export_to_dot, over its layers)"))
    compute_wait_ms_per_layer: float = key(0.0,
        help=("of a decoder layer's compute as the compute figures measured it (a wall time, the "
              "main and compute threads on separate cores), the time MLX's compute thread "
              "waits for operations the main thread has not dispatched yet (small operations "
              "are dispatched slower than they run), on a CPU backend: each layer's attention "
              "starts with this much of a wait that takes no core (sim.compute_stream), the "
              "main thread's dispatch (dispatch_cpu_ms_per_layer) running meanwhile; where the "
              "threads share one core the wait is that dispatch, and the attention is its CPU "
              "less this; 0 = none"),
        obtain=("measured by `ssdmoe calibrate` (the wall time of resident decode steps' "
                "evaluation less the compute thread's CPU time in it, the process's less the "
                "main thread's, over the layers)"))
    graph_of: str = key("",
        help=("the model profile whose decoder graph this model shares (the same layers, "
              "attention and operations; experts of another width): the graph's figures "
              "(GRAPH_KEYS: graph building, dispatch, the compute thread's wait, primitives) "
              "are that profile's wherever this one does not set them, so a calibration of "
              "that model gives them to this one (sim.profiles.load_model), and `sim compare` "
              "gives it that model's in-decode figures on this machine (sim.compare); \"\" = "
              "none"),
        obtain=("the profile of the model this one was derived from (ssdmoe fixture "
                "tiny-trained-wide widens tiny-trained's experts: graph_of = \"tiny-trained\")"))
    dispatch_cpu_ms_per_layer: float = key(0.0,
        help=("the main thread's CPU per decoder layer inside mx.eval and mx.async_eval: on a "
              "CPU backend MLX prepares and dispatches each operation on the calling thread "
              "while its compute thread runs the ones before. Charged while the main thread "
              "waits on compute (in either decode loop; fill_ms_per_layer, the part compute "
              "waits on, is part of it), so it takes a core beside the compute thread "
              "(sim.main_thread); 0 = not charged"),
        obtain=("measured by `ssdmoe calibrate` (the main thread's CPU time inside "
                "mx.async_eval of the walk to each router of a resident decode step), then "
                "fitted inside decode by `ssdmoe validate` from the main thread's measured CPU "
                "([in_decode] dispatch_cpu_ms_per_layer.in_decode)"))
    fill_ms_per_layer: float = key(0.0,
        help=("the lookahead decode loop's main-thread work at each layer's fill point that "
              "compute waits on: handing the gather and the walk to the next router over "
              "(mx.async_eval: MLX prepares and dispatches each operation on the calling thread; "
              "on a CPU backend the queue is nearly empty then) and the fill's host work; not in "
              "the synchronous loop, whose measured compute already holds its dispatch "
              "(sim.main_thread.dispatch)"),
        obtain="fitted inside decode by `ssdmoe validate` (calibration configurations)")
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
    path: str = key("staged",
        help="the engine's decode path: exact | hot | staged (sim.policies)",
        obtain="the engine preset's decode path (EngineConfig)")
    k: int = key(0,
        help="experts per token; 0 = the model's native K",
        obtain="the run's --top-k (0: the model's native K)")
    lead: str = key("none",
        help=("staged path: none (the router, on demand) | token (prediction heads, one token "
              "ahead, one flush per step) | layer (same token, lead_layers ahead)"),
        obtain="the engine config (--lead, --prerouter)")
    lead_layers: int = key(1,
        help="lead 'layer': how many layers ahead (the engine's layer lead: 1)",
        obtain="the engine config")
    decode_steps: int = key(200,
        help="decode steps simulated",
        obtain="the run")
    prefill_tokens: int = key(0,
        help="0 = no prefill step",
        obtain="the run")
    context_tokens: int = key(0,
        help="KV cache already held (memory only)",
        obtain="the run")
    lru_bytes: int = key(0,
        help=("bundle LRU shared by all layers: the hot path's budget; behind the staged path's "
              "slots, the paper's engine's bundle LRU (ours has none: 0); exact: none"),
        obtain="the engine config (--hot-mb)")
    cache_policy: str = key("lru",
        help=("eviction policy of the app caches (the hot path's pool, the bundle LRU, the "
              "staged slots) and of the engine's page-cache budget (engine_budget): lru | lfu | "
              "least-stale | fifo (contract.eviction) | belady (the optimum, simulator only: "
              "the hot path, no engine budget; sim.belady)"),
        obtain="the engine config (--cache-policy)")
    engine_budget: bool = key(False,
        help=("the page cache is the engine's page-cache budget (it drops pages itself, by "
              "cache_policy), not the kernel's (the hardware's page_cache_policy)"),
        obtain="sim compare: true where the trace ran with --page-cache-budget/-mb/-fraction")
    readers: int = key(0,
        help="reader threads; 0 = every load runs synchronously on the main thread",
        obtain="the engine config (--readers)")
    demand_pieces: int = key(1,
        help="reads per bundle on the demand path (tensor-wise partial reads)",
        obtain="the paper's engine: tensor-wise reads (ours: 1)")
    prefetch_pieces: int = key(1,
        help="reads per bundle on the prefetch path",
        obtain="the paper's engine (ours: 1)")
    prediction_is_routing: bool = key(True,
        help="prerouter: the predicted set is executed (no fallback)",
        obtain="the prerouter's design (the paper's: true)")
    prediction_accuracy: float = key(1.0,
        help="fraction of routed experts predicted (when not in trace)",
        obtain="the prerouter heads' measured recall (`ssdmoe eval`)")
    o_direct: bool = key(False,
        help="bypass the page cache: every read is cold",
        obtain="the engine config (--o-direct)")
    stager_dup_views: bool = key(False,
        help="stager keeps bundle and stacked views (paper: ~0.45 GiB @K=8)",
        obtain="the paper's engine")
    staged_headroom: int = key(-1,
        help=("staged slots per layer = K + this; -1 = K (EngineConfig's default: room to stage "
              "the next call's set while the last call's is in use)"),
        obtain="the engine config")
    cold_fill_compute_ms: float = key(0.0,
        help=("the compute thread's next work runs this much later after a fill that waited on a "
              "cold load (fitted inside decode by ssdmoe validate per decode loop, [in_decode] "
              "cold_fill_compute_ms.in_decode and .sync; 0 = none)"),
        obtain="fitted inside decode by `ssdmoe validate`")
    budget_evict_ms: float = key(0.0,
        help=("CPU per bundle the engine's page-cache budget drops (fadvise DONTNEED on its "
              "ranges, engine.store), on the reading thread after its read: only where the page "
              "cache is the engine's emulated budget (sim compare); 0 for a real OS page cache"),
        obtain=("sim compare: the bundle's pages x the hardware's page_drop_us_per_page, plus "
                "what `ssdmoe validate` fits inside decode beside it; 0 for a real OS page cache"))
    direct_reclaim: bool = key(False,
        help=("once the page cache is full, the reading thread frees as many pages as its cold "
              "read adds, inside the read (a memory control group at its limit reclaims in the "
              "allocating thread: no kswapd), at the hardware's reclaim_us_per_page"),
        obtain="sim compare: true where the trace ran under a memory limit (--mem-limit)")
    read_hold_ms: float = key(0.0,
        help="a wait inside every expert read, no CPU and the GIL let go (a what-if)",
        obtain="a what-if: a fixed delay added to every read")
    read_hold_busy: bool = key(False,
        help="the hold is CPU on the reading thread's core instead, the GIL let go",
        obtain="a what-if: reads that keep their thread busy")
    gil: bool = key(False,
        help=("the engine's threads share Python's interpreter lock (sim.gil): graph building "
              "and fill work on the main thread, each load's Python bookkeeping on its reader"),
        obtain="true for the Python engine")
    native_reads: bool = key(False,
        help=("reader threads run no Python (engine.native_reads): a load on one takes no "
              "GIL (the page-cache budget's drops included), and its Python (plan and row) "
              "is the main thread's when it collects the load"),
        obtain="the trace's run.json (engine readers_kind 'native')")
    help_reads: bool = key(True,
        help=("the main thread does a needed read no reader has started yet, and of a fill "
              "point's misses reads the first itself (EngineConfig.help_reads, engine.readers)"),
        obtain="the engine config (EngineConfig.help_reads)")
    lookahead: bool = key(False,
        help=("decode loop of our engine's staged path (engine.generate): step t+1's graph is "
              "built while step t computes, step t's work runs as soon as queued and each "
              "layer's fill (router sync, loads) is done as that layer of step t+1 is built. "
              "False: the synchronous loop (the paper's engine; ours on the exact and hot "
              "paths). sim.main_thread"),
        obtain="the engine config (--lookahead)")
    token_host_ms: float = key(0.0,
        help=("the main thread's Python per decode token beside graph building and fills (the "
              "trace recorder's per-step work): in the lookahead loop it runs after each "
              "token, holding the GIL, while the next step computes"),
        obtain="sim compare: the trace's run.json extra.recorder overhead_ms / steps")
    first_layer_hint: bool = key(False,
        help=("lookahead loop with prerouter heads: when a step's token is on the host, the "
              "experts a token table gives for the first MoE layer start reading into its "
              "free slots, beside its own routing (engine.first_layer_hint); replays the "
              "trace's hinted sets (routing column hinted_experts)"),
        obtain="the engine config (--first-layer-hint)")
    lora: bool = key(False,
        help=("serve the model's recovery LoRA, unmerged (its bytes and build time from the "
              "model profile: lora_bytes, lora_build_ms)"),
        obtain="the engine config (--lora)")
    prefill_stacks_held: bool = key(False,
        help=("the engine holds its two full-layer prefill stacks (2 x experts x bundle bytes) "
              "for its whole life: the whole-layer path allocates them when it is built "
              "(engine.paths.whole_layer), so they are engine memory at decode; false: they "
              "exist only while a prefill runs (the paper's engine)"),
        obtain=("sim compare: true where the trace's engine has a whole-layer prefill path "
                "(presets hot and staged)"))
    runtime_gib: float = key(0.0,
        help="other unreclaimable engine memory (activations, allocator slack)",
        obtain="the engine's measured memory beyond weights and caches (run.json)")
    routing_stats: str = key("scenario",
        help=("synthetic routing from overlap/skew below ('scenario'), or from the model "
              "profile's statistics fitted to traces, at this scenario's K ('model')"),
        obtain="scenario or model")
    overlap: float = key(0.25,
        help="synthetic routing: adjacent-token expert reuse",
        obtain="a what-if, or captured traces")
    skew: float = key(0.0,
        help="synthetic routing: per-layer expert popularity skew",
        obtain="a what-if, or captured traces")
    recall: float = key(0.0,
        help="synthetic routing: share of fresh draws copied from recent tokens",
        obtain="a what-if, or captured traces")
    recall_window: int = key(16,
        help="... from the sets of this many last tokens",
        obtain="a what-if, or captured traces")
    seed: int = key(0,
        help="the synthetic routing's seed",
        obtain="the run")
    source: str = ""  # file the scenario came from (for error messages and run.json)
    notes: dict[str, str] = key({},
        help="records in words (key -> text): what a profile value came from",
        obtain="written by `ssdmoe calibrate`")
    in_decode: dict[str, float] = key({},
        help=("figures fitted inside decode (sim.in_decode: figure or figure.variant -> number), "
              "which `sim compare` applies per engine configuration"),
        obtain="written by `ssdmoe calibrate` (starting values) and refitted by `ssdmoe validate`")

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
        cached = self.path != "exact" or self.engine_budget
        policy = f", cache policy {self.cache_policy}" if cached else ""
        return f"path {self.path}{lead}, readers {self.readers}{policy}"

    @property
    def predicts(self) -> bool:
        """Staged routing known ahead: prediction heads (lead token) or the layer lead."""
        return self.path == "staged" and self.lead != "none"


SCENARIO_KEYS = tuple(
    f.name for f in fields(Scenario) if f.name not in ("name", "hardware", "model", "source",
                                                        "notes", "in_decode")
)
# the model profile's routing statistics, fitted per K (sim.routing_fit); each has a
# prerouted_ twin for the prerouter's heads' routing
ROUTING_KEYS = ("routing_k", "routing_reuse", "routing_skew", "routing_recall",
                "routing_recall_window")
HARDWARE_KEYS = tuple(f.name for f in fields(Hardware) if f.name not in ("name", "description"))
HARDWARE_OPTIONAL = ("expert_gbps", "expert_size_bytes", "expert_size_gbps",
                     "expert_overhead_ms", "sync_overhead_ms", "lazy_compute",
                     "handoff_ms", "gil_handoff_ms", "cold_read_cpu_ms",
                     "cold_read_cpu_us_per_page", "reader_wake_ms",
                     "throttle_read_mbps", "throttle_read_iops", "throttle_burst_s",
                     "throttle_kind", "page_cache_policy", "compute_factor", "cpu_cores",
                     "compute_on_cpu",
                     "background_cores", "page_cache_floor_gib", "os_floor_gib", "queue_ahead_ms",
                     "gather_queue_ahead_ms",
                     "refused_warm_ms", "fill_host_ms_per_load", "zero_fill_gbps",
                     "zero_fill_rotation_mib",
                     "zero_fill_rotation_gbps", "page_drop_us_per_page", "reclaim_us_per_page",
                     "thread_cores",
                     "cross_core_op_us", "cross_core_op_main_us")
MODEL_KEYS = tuple(f.name for f in fields(ModelProfile) if f.name not in ("name", "description"))
