"""calibration.fill_probe: a staged fill's main-thread host work per load, timed inside sampled
decode: positive, and a part of the main thread's CPU per load over the same decode."""

from __future__ import annotations

import math

from calibration.fill_probe import fill_host_ms


def test_the_fill_work_per_load_is_a_part_of_the_main_threads_cpu(tiny_random_converted):
    import time

    c0 = time.thread_time()
    per_load, loads = fill_host_ms(tiny_random_converted, tokens=12)
    main_ms = (time.thread_time() - c0) * 1e3  # the whole probe on this thread
    assert loads > 0 and not math.isnan(per_load)
    # a wrapper that times nothing gives 0; one that times the whole decode, the whole thread
    assert 0.0 < per_load * loads < 0.5 * main_ms
