"""The main thread's host work a staged fill spends per expert it loads (sim key
fill_host_ms_per_load): placing it in a slot, planning and submitting its read, waiting for it
and collecting it (engine.paths.slot_table.SlotTable.place and settle), timed as the main
thread's CPU inside sampled decode of the staged path with the layer lead (any model has it: no
heads needed), every expert in the page cache. Its reads all go to the reader threads (help
off), so what is timed is the fill's bookkeeping and hand-offs, not a copy: the simulator
charges each read's own work where it runs (sim.loads)."""

from __future__ import annotations

import time
from pathlib import Path

PROMPTS = ("The history of the", "Once upon a time")


def fill_host_ms(converted: Path, tokens: int = 48) -> tuple[float, int]:
    """(main-thread CPU ms per load of the staged fills, loads timed); (nan, 0) without loads."""
    from contract.engine_config import EngineConfig
    from engine.generate import generate
    from engine.loader import load_streaming, streaming_blocks

    config = EngineConfig.from_preset("staged", lead_kind="layer", help_reads=False)
    loads: list[dict] = []
    engine = load_streaming(Path(converted), config=config, on_load=loads.append)
    spent = [0]

    def timed(fn):
        def run(*args, **kwargs):
            c0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.thread_time_ns() - c0
        return run

    try:
        for block in streaming_blocks(engine.model).values():
            table = getattr(block.path, "slot_table", None)
            if table is not None:
                table.place, table.settle = timed(table.place), timed(table.settle)
        generate(engine.model, engine.tokenizer, "Hello", 8, temp=1.0, seed=0,
                 stop_at_eos=False, runtime=engine.runtime)  # warm-up: every expert cached
        spent[0], loads[:] = 0, []
        for seed, prompt in enumerate(PROMPTS, start=1):
            generate(engine.model, engine.tokenizer, prompt, tokens, temp=1.0, seed=seed,
                     stop_at_eos=False, runtime=engine.runtime)
    finally:
        engine.close()
    timed_loads = sum(1 for r in loads if r["expert"] >= 0)
    if not timed_loads:
        return float("nan"), 0
    return spent[0] / 1e6 / timed_loads, timed_loads
