"""The closed-form device (sim.storage) against the device as SimPy processes and resources
(sim.device_process), read by read: the shortcut the simulator takes must equal the DES."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from sim.device_process import DeviceProcess
from sim.storage import Device
from sim.token_bucket import make_throttle


def _arrivals(seed: int, n: int, rate: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    sizes = rng.choice([4096, 61_440, 262_144, 1_769_472], n)
    return times, sizes


def _des(times, sizes, latency, bandwidth, qd, throttle_rate=None,
         kind: str = "token-bucket") -> list[tuple[float, float]]:
    env = simpy.Environment()
    bucket = make_throttle(kind, throttle_rate, 0.05) if throttle_rate else None
    dev = DeviceProcess(env, latency, bandwidth, qd, throttle_bytes=bucket)
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(times)

    def one(i: int):
        out[i] = yield from dev.read(int(sizes[i]))

    def source():
        for i, t in enumerate(times):
            yield env.timeout(t - env.now)
            env.process(one(i))

    env.process(source())
    env.run()
    return out


@pytest.mark.parametrize("qd,rate,throttle,kind", [
    (1, 800, None, ""), (2, 3000, None, ""), (8, 20000, None, ""),
    (4, 3000, 40e6, "token-bucket"), (4, 3000, 40e6, "blk-throttle")])
def test_closed_form_device_equals_the_des(qd, rate, throttle, kind):
    latency, bandwidth = 0.0001, 1.5e9
    times, sizes = _arrivals(qd, 3000, rate)
    des = _des(times, sizes, latency, bandwidth, qd, throttle, kind)
    closed = Device(latency, bandwidth, qd)
    if throttle:
        closed.throttle_bytes = make_throttle(kind, throttle, 0.05)
    got = [closed.read(float(t), int(b)) for t, b in zip(times, sizes, strict=True)]
    finish_des = np.array([f for _, f in des])
    finish_closed = np.array([f for _, f in got])
    waited = finish_des - times - latency - sizes / bandwidth
    assert waited.max() > 1e-4  # the load is high enough that requests queue
    np.testing.assert_allclose(finish_closed, finish_des, rtol=0, atol=1e-9)
    np.testing.assert_allclose([s for s, _ in got], [s for s, _ in des], rtol=0, atol=1e-9)
