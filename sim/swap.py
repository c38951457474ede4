"""Oversubscribed memory: what happens when the engine, the OS and the page cache's floor do not
fit in RAM together (sim.memory_budget).

The page cache gives way first, down to the floor the kernel keeps for file pages
(`page_cache_floor_gib`). Past that the kernel pages out the engine's own (anonymous) memory, a
fraction `swapped` of it, and the engine faults those pages back in as it touches them: every
layer's compute touches its share of the resident weights and KV cache, every app-cache hit
touches a bundle. A fault reads the page back from the device (sim.storage's first-in-first-out
`read`, costed when the work is handed over; it queues behind the other page-ins, not behind the
expert reads, whose shared transfers it does not see) and pays the fault work (cold_overhead_ms).
Which touches fault is decided by an accumulator, not a random draw: each touch adds `swapped`
to a debt and faults when the debt reaches one page's worth, so the faulted bytes are exactly
`swapped` of the touched bytes.

With nothing oversubscribed `swapped` is 0 and every cost here is 0 (no device requests).
"""

from __future__ import annotations

from sim.storage import Device


class Swap:
    def __init__(self, swapped: float, device: Device, fault_s: float,
                 layer_touch_bytes: int) -> None:
        if not 0.0 <= swapped <= 1.0:
            raise ValueError("swapped fraction must be in [0, 1]")
        self.swapped = swapped
        self.device = device
        self.fault_s = fault_s
        self.layer_touch_bytes = layer_touch_bytes  # resident + KV bytes one layer touches
        self._hit_debt = 0.0
        self.faults = 0
        self.fault_bytes = 0

    def _read(self, now: float, nbytes: int) -> float:
        self.faults += 1
        self.fault_bytes += nbytes
        _, finish = self.device.read(now, nbytes)
        return finish - now + self.fault_s

    def hit_cost(self, now: float, nbytes: int) -> float:
        """Seconds an app-cache hit of `nbytes` costs the thread that touches it."""
        if not self.swapped:
            return 0.0
        self._hit_debt += self.swapped
        if self._hit_debt < 1.0:
            return 0.0
        self._hit_debt -= 1.0
        return self._read(now, nbytes)

    def layer_fault_s(self, now: float) -> float:
        """Seconds one layer's compute stalls on faulting its swapped resident and KV pages."""
        if not self.swapped or not self.layer_touch_bytes:
            return 0.0
        return self._read(now, int(self.swapped * self.layer_touch_bytes))
