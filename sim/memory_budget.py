"""Memory budget: what is unreclaimable, and what is left for the OS page cache.

RAM = what the OS and other processes hold + engine (resident weights + KV cache + heads +
adapter + bundle LRU + staged slot tables and their views + runtime) + page cache. The page
cache gets what is left, so every byte an app cache holds is a byte the page cache cannot: a
bigger app cache can starve it.
Under memory pressure the kernel gives way in this order:
  1. the page cache, down to its floor for file pages (`page_cache_floor_gib`);
  2. other processes' idle memory, down to `os_floor_gib` (macOS compresses it; -1: it does
     not shrink, as on Linux without swap or zswap, and the OS holds `os_reserve_gib`);
  3. the engine's own memory: the difference is paged out of it, and `swapped` is that
     fraction of the engine's bytes, which sim.swap turns into faults (reads that slow down).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.scenario import GIB, Scenario


@dataclass
class MemoryBudget:
    ram: int
    os_reserve: int
    resident: int
    kv: int
    heads: int
    adapter: int  # the recovery LoRA, unmerged
    lru: int
    slots: int  # the staged path's slot tables: K + headroom slots per layer
    slot_views: int  # duplicate bundle views the stager keeps (the paper's, at consumer layers)
    runtime: int
    prefill_buffers: int  # whole-layer buffers while a prefill runs (transient)
    prefill_stacks: int = 0  # the same buffers held for the engine's life (engine memory)
    page_cache_floor: int = 0
    os_floor: int = -1  # what the OS and others shrink to under pressure (-1: they do not)

    @property
    def engine(self) -> int:
        """What the engine holds at decode (the MLX allocation)."""
        return (self.resident + self.kv + self.heads + self.adapter + self.lru + self.slots
                + self.slot_views + self.runtime + self.prefill_stacks)

    @property
    def os_least(self) -> int:
        """The least the OS and other processes hold under pressure (their reserve where they
        do not give way)."""
        return self.os_reserve if self.os_floor < 0 else self.os_floor

    @property
    def os_held(self) -> int:
        """What the OS and other processes hold: their reserve, less what the kernel takes
        from them (down to `os_least`) so that the engine and the page cache's floor fit."""
        room = self.ram - self.engine - self.page_cache_floor
        return min(self.os_reserve, max(self.os_least, room))

    @property
    def unreclaimable(self) -> int:
        return self.os_held + self.engine

    @property
    def left(self) -> int:
        """RAM minus what the OS holds and the engine (negative when they do not fit)."""
        return self.ram - self.unreclaimable

    @property
    def page_cache(self) -> int:
        return max(self.left, min(self.page_cache_floor, max(self.ram - self.os_held, 0)))

    @property
    def oversubscribed(self) -> int:
        """Bytes of the engine's memory paged out (0 when everything fits)."""
        return max(self.unreclaimable + self.page_cache - self.ram, 0)

    @property
    def swapped(self) -> float:
        """Fraction of the engine's memory paged out."""
        return min(self.oversubscribed / self.engine, 1.0) if self.engine else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {name: int(getattr(self, name))
                                 for name in self.__dataclass_fields__}
        out.update(engine=self.engine, os_held=self.os_held, unreclaimable=self.unreclaimable,
                   page_cache=self.page_cache, oversubscribed=self.oversubscribed)
        out["swapped_fraction"] = self.swapped
        return out


def predicted_layers(sc: Scenario) -> int:
    """Layers whose routing the prediction heads stage (lead token): the consumers."""
    return sc.model.consumer_count if sc.predicts and sc.lead == "token" else 0


def budget(sc: Scenario) -> MemoryBudget:
    m, hw = sc.model, sc.hardware
    tokens = sc.context_tokens + sc.prefill_tokens + sc.decode_steps
    heads = sc.predicts and sc.model.consumer_count > 0  # heads (or the layer lead's routers)
    stacks = 2 * m.experts * m.bundle_bytes  # the whole-layer path's two full-layer stacks
    return MemoryBudget(
        ram=int(hw.ram_gib * GIB),
        os_reserve=int(hw.os_reserve_gib * GIB),
        resident=m.resident_bytes,
        kv=m.kv_bytes_per_token * tokens,
        heads=m.heads * m.head_bytes if heads else 0,
        adapter=m.lora_bytes if sc.lora else 0,
        lru=sc.lru_bytes,
        slots=m.layers * sc.staged_slots * m.bundle_bytes,
        slot_views=predicted_layers(sc) * sc.k * m.bundle_bytes if sc.stager_dup_views else 0,
        runtime=int(sc.runtime_gib * GIB),
        prefill_buffers=stacks if sc.prefill_tokens and not sc.prefill_stacks_held else 0,
        prefill_stacks=stacks if sc.prefill_stacks_held else 0,
        page_cache_floor=int(hw.page_cache_floor_gib * GIB),
        os_floor=int(hw.os_floor_gib * GIB) if hw.os_floor_gib >= 0 else -1,
    )
