"""Thresholds the engine and the simulator must agree on (both import them from here).

INLINE_WARM_BYTES: a demand miss that the page cache holds, up to this size, is copied by the
engine's main thread itself when it must wait for it (engine.readers.ReaderPool.wait;
sim.main_thread's new_load). Such a copy (~60 KB: ~20-40 us on the 2-core dev VM) is shorter
than a hand-off to a reader and back (reports/bench/roundtrip.py; calibrate's handoff_ms); bigger
ones are worth copying in parallel on the readers.

Imports nothing of ours."""

from __future__ import annotations

INLINE_WARM_BYTES = 256 << 10
