"""The whole-layer path: one 9-tensor read per layer per prefill forward, done by a reader
thread, issued one layer ahead (during the previous layer's call), waits recorded."""

from __future__ import annotations

import time

import mlx.core as mx

from contract.engine_config import EngineConfig
from engine.loader import load_streaming, streaming_blocks


def test_reads_whole_layers_one_layer_ahead(tiny_random_converted):
    config = EngineConfig(prefill="whole-layer", decode="exact", help_reads=False)
    loads: list[dict] = []
    eng = load_streaming(tiny_random_converted, config=config, on_load=loads.append)
    model, tok, store = eng.model, eng.tokenizer, eng.store
    m = store.manifest
    routed_at: dict[int, int] = {}
    for block in streaming_blocks(model).values():
        block.on_routing = lambda i, inds, w: routed_at.__setitem__(i, time.perf_counter_ns())
    before = eng.runtime.stats.snapshot()
    mx.eval(model(mx.array(tok.encode("whole layers, read ahead " * 3))[None]))
    blocked = eng.runtime.stats.blocked_ns - before["blocked_ns"]
    assert [r["layer"] for r in loads] == m.moe_layers
    for r in loads:
        t = m.layers[r["layer"]].tensors
        assert r["expert"] == -1 and r["source"] == "whole_layer"
        # the bundled layout: every bundle and the padding between them, one span
        first = min(x.offset for x in t.values())
        last = max(x.offset + (x.shape[0] - 1) * x.stride + x.nbytes for x in t.values())
        assert r["bytes"] == last - first
        assert r["thread"].startswith("reader-")
        assert r["waited"] == (r["wait_ns"] > 0) and r["issued_ns"] <= r["started_ns"]
    # layer i+1's read is issued inside layer i's call: after layer i's router was built,
    # before layer i+1's router was (so it overlaps layer i's compute)
    by_layer = {r["layer"]: r for r in loads}
    for a, b in zip(m.moe_layers, m.moe_layers[1:], strict=False):
        assert routed_at[a] < by_layer[b]["issued_ns"] < routed_at[b]
    assert sum(r["wait_ns"] for r in loads) == blocked
    eng.close()
