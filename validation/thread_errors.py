"""A decode step's CPU by thread, measured against simulated over configurations: the complete
split of a summary (traces.summary.cpu_by_thread with the readers' CPU known) and each thread's
median signed error. `ssdmoe validate`'s report and reports/cross-machine/thread_cpu.py share
them. No MLX here."""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from traces.summary import cpu_by_thread

THREADS = ("compute", "main", "readers")
MIN_MS = 0.1  # a thread's error is counted where it measured at least this much a step


def complete_split(summary: dict) -> dict[str, float] | None:
    """{thread: ms a step} over THREADS; None where a figure is missing (a trace without the
    readers' column, or without CPU figures at all)."""
    threads = cpu_by_thread(summary)
    return threads if set(threads) == set(THREADS) and None not in threads.values() else None


def signed_errors(pairs: Iterable[tuple[dict[str, float], dict[str, float]]]
                  ) -> dict[str, dict[str, float | int | None]]:
    """Per thread, over the (measured, simulated) splits where it measured at least MIN_MS a
    step: {"points": n, "median_signed_error_pct": median of 100 (s / m - 1), None without
    any}."""
    pairs = list(pairs)
    out: dict[str, dict[str, float | int | None]] = {}
    for t in THREADS:
        errors = [100 * (s[t] / m[t] - 1) for m, s in pairs if m[t] >= MIN_MS]
        out[t] = {"points": len(errors),
                  "median_signed_error_pct": statistics.median(errors) if errors else None}
    return out
