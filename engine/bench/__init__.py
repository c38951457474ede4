"""Benchmarking the engine: arms against mlx-lm resident in rotated rounds (benchmark, each
arm in its own process: arm), their plot (plot), and what recording a trace costs
(trace_overhead)."""
