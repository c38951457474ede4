"""Thresholds and sizes the engine and the simulator must agree on (both import them here).

INLINE_WARM_BYTES: a demand miss that the page cache holds, up to this size, is copied by the
engine's main thread itself when it must wait for it (engine.readers.ReaderPool.wait;
sim.main_thread's new_load). Such a copy (a tiny-trained bundle is 60 KB) is shorter than a
hand-off to a reader and back (reports/bench/roundtrip.py; calibrate's handoff_ms); bigger ones
are worth copying in parallel on the readers.

Imports nothing of ours."""

from __future__ import annotations

INLINE_WARM_BYTES = 256 << 10

# The streaming layout's alignment: every tensor's data starts on this boundary, so O_DIRECT
# reads (offset, length and buffer aligned) can read whole tensors (engine.safetensors_io,
# engine.store; calibration.profile_values' O_DIRECT probes).
ALIGN = 4096
# The page the page cache and the engine's budget round a read's ranges out to (mmap.PAGESIZE
# on the machine: 4 KiB on x86-64 Linux; Apple Silicon's is 16 KiB). The engine uses the
# machine's own; the simulator uses this unless a profile says otherwise.
PAGE = 4096

# The page-cache sizes that validation's matrix and advise's machines are named by: the share
# of a model's expert bytes the page cache may hold (None: no budget, every expert may stay).
PAGE_CACHE_SHARES: dict[str, float | None] = {"all": None, "1/2": 0.5, "1/4": 0.25}
