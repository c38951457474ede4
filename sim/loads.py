"""A load (one bundle, or one whole layer at prefill) and what performing it costs.

Cost of a load started at time s by some thread (main or a reader):
    cold: device read (sim.storage: queueing + latency + bytes / bandwidth), then the bundle
          enters the page cache; warm: page-cache hit, no device time
    copy: bytes / memcpy (page cache -> engine memory; 0 when memcpy_gbps is 0)
    CPU:  pieces x load_overhead + cold pieces x cold_overhead, on the thread doing the load
A bundle may be read as several pieces (tensor-wise partial reads, `*_pieces`): with readahead
the first cold piece brings the whole bundle in and the others are warm; without it every piece
of a cold bundle is a separate device request.
"""

from __future__ import annotations

from sim.page_cache import PageCache
from sim.scenario import Hardware
from sim.storage import Device

DEMAND, PREFETCH, WHOLE_LAYER = "demand", "prefetch", "whole_layer"


class Load:
    __slots__ = ("step", "layer", "expert", "nbytes", "pieces", "source", "issued", "started",
                 "finished", "cold", "cold_pieces", "waited", "wait", "thread", "priority",
                 "seq", "key")

    def __init__(self, step: int, layer: int, expert: int, key: int, nbytes: int, pieces: int,
                 source: str, issued: float, priority: int = 1) -> None:
        self.step = step
        self.layer = layer
        self.expert = expert
        self.key = key
        self.nbytes = nbytes
        self.pieces = pieces
        self.source = source
        self.issued = issued
        self.started = -1.0
        self.finished = -1.0  # < 0 until performed
        self.cold = False
        self.cold_pieces = 0
        self.waited = False
        self.wait = 0.0
        self.thread = ""
        self.priority = priority
        self.seq = 0


class Fetcher:
    """Performs loads against the page cache and the device; keeps the load log."""

    def __init__(self, hw: Hardware, device: Device, page_cache: PageCache,
                 experts: int, bundle_bytes: int) -> None:
        self.device = device
        self.pc = page_cache
        self.experts = experts
        self.bundle_bytes = bundle_bytes
        self.overhead = hw.load_overhead_ms / 1e3
        self.cold_overhead = hw.cold_overhead_ms / 1e3
        self.copy_bps = hw.memcpy_gbps * 1e9
        self.readahead = hw.readahead
        self.log: list[Load] = []

    def perform(self, load: Load, start: float, thread: str) -> float:
        """Run `load` from `start` on `thread`; fills its fields and returns its finish time."""
        load.started = start
        load.thread = thread
        if load.expert < 0:
            return self._whole_layer(load, start)
        io_end = start
        if self.pc.probe(load.key):
            cold_pieces = 0
        else:
            requests = 1 if self.readahead else load.pieces
            cold_pieces = requests
            _, io_end = self.device.read(start, load.nbytes, requests)
            self.pc.fill(load.key)
        if self.copy_bps:
            io_end += load.nbytes / self.copy_bps
        load.cold = cold_pieces > 0
        load.cold_pieces = cold_pieces
        load.finished = io_end + load.pieces * self.overhead + cold_pieces * self.cold_overhead
        self.log.append(load)
        return load.finished

    def _whole_layer(self, load: Load, start: float) -> float:
        missing = self.pc.probe_layer(load.layer)
        io_end = start
        if missing:
            _, io_end = self.device.read(start, missing * self.bundle_bytes, load.pieces)
            self.pc.fill_layer(load.layer)
        if self.copy_bps:
            io_end += load.nbytes / self.copy_bps
        load.cold = missing > 0
        load.cold_pieces = 1 if missing else 0
        load.finished = io_end + load.pieces * self.overhead + load.cold_pieces * self.cold_overhead
        self.log.append(load)
        return load.finished
