"""Calibration: this machine measured, for the simulator's profiles. Sits above engine/ and
sim/ (the one package besides the CLI and validation that uses both):

  storage_probes     real reads of a scratch file: cold, warm, uncached latency, queue depth
                     (macOS: F_NOCACHE where Linux drops pages; engine.platform)
  compute_probes     the real engine's pieces: kernel, graph building, paths, hand-off (MLX)
  bundle_views       one expert row's buffers per layer, for the probes' bundle reads
  scratch_reads      reads of the scratch file the storage probes share (a whole range, offsets)
  reclaim_probe      cold reads at a memory control group's limit against outside one (Linux)
  queue_depth_probe  the device's throughput against reads in flight, at the model's read size
  machine            RAM, what the OS holds, cores, where MLX computes
  profile_values     measurements -> profile values with small closed-form fits (no MLX, no I/O)
  calibrate          `calibrate()`: all of them, turned into profile values
"""
