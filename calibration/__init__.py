"""Calibration: this machine measured, for the simulator's profiles. Sits above engine/ and
sim/ (the one package besides the CLI and validation that uses both):

  storage_probes  real reads of a scratch file: cold, warm, O_DIRECT latency, queue depth
  compute_probes  the real engine's pieces: kernel, graph building, paths, hand-off (MLX)
  machine         RAM, what the OS holds, cores, where MLX computes
  run             `calibrate()`: all of them, turned into profile values by
                  sim.calibration_values (no MLX, no I/O) and sim.model_profile
"""
