"""Calibration: this machine measured, for the simulator's profiles. Sits above engine/ and
sim/ (the one package besides the CLI and validation that uses both):

  storage_probes     real reads of a scratch file: cold, warm, O_DIRECT latency, queue depth
  compute_probes     the real engine's pieces: kernel, graph building, paths, hand-off (MLX)
  concurrent_reads   cold bundle reads on several threads at once (bundle_views: where)
  queue_depth_probe  the device's throughput against reads in flight, at the model's read size
  sched_probe        how the kernel shares cores between a reader's bursts and a busy thread
  core_wait_probe    a reader's wait for a core beside the decoding engine
  stall_probe        what a thread pays to run again after the main thread blocked on loads
  idle_probe         how much slower the engine steps after the process has idled
  probe_capture      the two probes' captures: the engine's own capture with their hooks
  machine            RAM, what the OS holds, cores, where MLX computes
  profile_values     measurements -> profile values with small closed-form fits (no MLX, no I/O)
  calibrate          `calibrate()`: all of them, turned into profile values
"""
