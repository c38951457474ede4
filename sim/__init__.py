"""The simulator (no MLX, ever): a SimPy model of storage, page cache, engine caches, staged slots,
reader threads and the main thread that replays a trace (or synthetic routing) and writes a
simulated trace in the same schema as a measured one.

  scenario.py     Hardware / ModelProfile / Scenario dataclasses
  profiles.py     TOML loading, validation, --set key=value overrides
  memory.py       RAM budget: unreclaimable memory and the page cache left
  storage.py      the device (queue depth, latency, shared bandwidth)
  throttle.py     the kernel's block-I/O read throttle in front of it (a token bucket)
  lru.py          byte-bounded LRU; page_cache.py (OS page cache), caches.py (bundle LRU, slots)
  loads.py        a load and its cost (page cache -> device -> CPU overheads)
  readers.py      reader threads: priority queue, demand before prefetch
  policies.py     on-demand, hot, prerouter (lead one token or N layers)
  main_thread.py  the SimPy process: graph build, accelerator timeline, waits
  routing_input.py, routing_synth.py   what is replayed
  record.py       simulated run -> trace tables; replay.py: run_scenario()
  sweep.py        grids of scenarios in worker processes -> Parquet + PNG (`sim sweep`)
  compare.py      a measured trace replayed with its engine config, side by side (`sim compare`)
  model_profile.py  a model profile from a converted model's manifest (`sim profile-model`)
  calibrate.py    storage probes, fits and profile writers for `ssdmoe calibrate` (the engine
                  timings are engine/calibrate.py's)
"""
