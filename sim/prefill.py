"""A prefill step on the main thread: every layer's experts as one whole-layer load (the
engine's whole-layer path), layer L+1's load issued as layer L's compute is queued so the two
overlap. Compute is the larger of the tokens' FLOPs and the bytes the layer touches."""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING

from traces.schema import WHOLE_LAYER

if TYPE_CHECKING:
    from sim.main_thread import MainThread


def whole_layer_prefill(main: MainThread, step: int, request: int, tokens: int) -> Generator:
    start = main.env.now
    main.begin_step()
    m = main.sc.model
    layer_bytes = main.experts * main.bundle_bytes
    # distinct experts a layer's tokens touch (expected, uniform routing)
    touched = main.experts * (1 - (1 - main.sc.k / main.experts) ** tokens)
    compute = max(tokens * 2 * m.active_params / m.layers / main.flops,
                  (m.resident_bytes / m.layers + touched * main.bundle_bytes) / main.mem_bw)

    def whole(layer: int) -> Generator:
        return main.new_load(step, layer, -1, -1, layer_bytes, m.whole_layer_reads,
                             WHOLE_LAYER)

    upcoming = yield from whole(0)
    for layer in range(main.layers):
        yield from main.cpu(main.build_s)
        yield from main.wait(upcoming)
        main.compute.submit(compute + main.swap.layer_fault_s(main.env.now))
        if layer + 1 < main.layers:
            upcoming = yield from whole(layer + 1)  # overlaps this layer's compute
    yield from main.gpu_sync()
    main.record_step(step, request, "prefill", tokens, start)
