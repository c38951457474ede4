"""The simulator (no MLX, ever): a discrete-event model in SimPy of a machine serving an MoE from
SSD. Every actor that waits or contends is a process or a resource: the main thread (graph
building, syncs, fills), the compute stream, reader threads, the storage device, the host's CPU
cores (shared by all of them) and memory (RAM split between the OS, the engine, its caches and the
page cache). It replays a trace (or synthetic routing) and writes a simulated trace in the same
schema as a measured one.

  scenario.py        Hardware / ModelProfile / Scenario dataclasses
  profiles.py        TOML loading, validation, --set key=value overrides
  sharing.py         processor sharing, the mechanism of cpu.py
  cpu.py             the host's cores: processor sharing among every thread that computes
  gil.py             Python's interpreter lock: graph building vs readers' bookkeeping, its
                     hand-over to a thread that slept on it, and the main thread taking it
                     back after an MLX call or a wait that let go of it
  compute_stream.py  the accelerator's command stream (on a CPU backend: a thread on the cores;
                     a bounded queue: async eval returns once little is left queued)
  main_thread.py     the main thread's process: graph build, fills, syncs, waits; a prefill
                     step's whole-layer loads overlapping the layers' compute
  reader_threads.py  reader threads: processes on one first-in first-out queue (the engine's)
  loads.py           a load and its cost by where its bytes are (page cache, device) + CPU work,
                     a cold read's kernel CPU running beside its device time
  storage.py         the device, closed form (queue depth, latency, shared bandwidth)
  device_process.py  the same device as SimPy resources: the reference the closed form equals
  bisection.py       where a decreasing function crosses a target (the fits that run the sim)
  token_bucket.py    a read throttle in front of it: the kernel's blk-throttle (a slice's
                     bytes at full speed, then a wait) or a token bucket (a cloud disk)
  memory_budget.py   RAM budget: OS, engine, app caches; the page cache gets what is left
  swap.py            oversubscription: the engine's paged-out memory faulted back in
  bounded_cache.py   a byte-bounded cache whose victims an eviction policy names (the
                     engine's own, contract/eviction.py; belady.py: Belady's optimum);
                     page_cache.py (OS page cache, or the engine's budget), caches.py (the
                     bundle cache, the staged path's per-layer slot tables)
  policies.py        the engine's decode paths: exact, hot, staged (lead none, token, layer)
  routing_input.py, routing_synth.py   what is replayed; routing_fit.py: the generator's
                     reuse and skew (and their scaling with K) fitted to captured traces
  record.py          simulated run -> trace tables; replay.py: run_scenario()
  sweep.py           grids of scenarios in worker processes -> Parquet + PNG (`sim sweep`;
                     sweep_outputs.py writes the Parquet, the PNGs and the README);
                     sweep_ray.py: the same points as Ray tasks (`--backend ray`)
  compare.py         a measured trace replayed with its engine config, side by side
  in_decode.py       what `ssdmoe validate` fits inside decode, read once from a scenario's
                     notes as one typed record, and handed to a replay by its configuration
  model_profile.py   a model profile from a converted model's manifest (`sim profile-model`)
  key_reference.py   docs/simulator.md from the dataclasses' key metadata (`sim keys`)
  profile_toml.py    profile files as commented TOML (each value with how it was obtained;
                     calibration/profile_values.py turns `ssdmoe calibrate`'s measurements
                     into values)

What models what (engine module -> sim module); both sides share contract/ (EngineConfig, path
names, thresholds) and traces/ (the schema, load sources):
  engine/generate.py (decode loop, lookahead)      main_thread.py, compute_stream.py
  engine/fill_points.py (deferred routing syncs)   main_thread.py (fills)
  engine/readers.py (reader threads, help_reads)   reader_threads.py, gil.py
  engine/native_reads.py (no GIL on the readers)   loads.py (native_reads), main_thread.py
  engine/store.py (reads, cold/warm, budget),      loads.py (bundle_reads: 1 bundled, one
    engine/read_plan.py (vectored reads),            per slice stacked), page_cache.py,
    engine/manifest.py (layout)                      storage.py, token_bucket.py
                                                   (engine/throttle.py), model_profile.py
  engine/paths/exact.py                            policies.py Exact (path "exact")
  engine/paths/hot.py                              policies.py Hot (path "hot"), caches.py
  engine/page_cache_budget.py                      page_cache.py (engine_budget)
  engine/paths/staged.py, slot_table.py            policies.py Staged (path "staged"),
                                                   caches.py SlotTables
  engine/paths/staged_fill.py (demand, ahead,      main_thread.py (_router_layer, stage,
    predicted fills)                                 _staged_layer)
  engine/prerouter.py, engine/layer_lead.py        policies.py StagedTokenLead, StagedLayerLead
                                                   (lead "token" / "layer")
  engine/paths/whole_layer.py (prefill)            main_thread.py (prefill_step)
  engine/memory.py (RSS, MLX bytes)                memory_budget.py, swap.py
  engine/lora.py (adapter bytes, build)            model_profile.lora_profile, main_thread.py
"""
