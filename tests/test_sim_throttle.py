"""The simulated read throttle (sim.throttle.TokenBucket, in front of sim.storage.Device),
against hand-worked token-bucket sequences: demand below the rate passes untouched, demand
above it is held to the rate after one burst, and requests pass in arrival order."""

from __future__ import annotations

import pytest

from sim.storage import Device
from sim.throttle import TokenBucket

MB = 1e6


def test_back_to_back_requests_are_held_to_the_rate_after_one_burst():
    b = TokenBucket(rate=10 * MB, burst_s=0.1)  # 1 MB bucket
    starts = [b.admit(0.0, 1 * MB) for _ in range(100)]
    # the first MB passes at once (the full bucket); each later one waits 0.1 s for its tokens
    assert starts[0] == 0.0
    assert starts[1] == pytest.approx(0.1)
    assert starts[-1] == pytest.approx(9.9)


def test_demand_below_the_rate_is_never_delayed():
    b = TokenBucket(rate=10 * MB, burst_s=0.1)
    # 0.5 MB every 0.1 s is 5 MB/s: the bucket refills faster than it drains
    for i in range(50):
        assert b.admit(0.1 * i, 0.5 * MB) == pytest.approx(0.1 * i)


def test_bursty_demand_with_average_below_rate():
    b = TokenBucket(rate=10 * MB, burst_s=0.1)
    # a 3 MB burst at t=0: 1 MB passes, then 0.1 s per MB; then idle refills the bucket
    assert [b.admit(0.0, MB) for _ in range(3)] == pytest.approx([0.0, 0.1, 0.2])
    assert b.admit(1.0, MB) == pytest.approx(1.0)  # refilled (capped at 1 MB) by t=1


def test_fifo_a_small_request_waits_behind_a_held_one():
    b = TokenBucket(rate=1 * MB, burst_s=0.0)
    assert b.admit(0.0, 2 * MB) == pytest.approx(2.0)
    assert b.admit(0.5, 1) == pytest.approx(2.0 + 1 / MB)


def test_device_reads_throttled_throughput_matches_rate():
    dev = Device(latency_s=50e-6, bandwidth_bps=2000 * MB, queue_depth=4)
    dev.throttle_bytes = TokenBucket(rate=20 * MB, burst_s=0.1)
    t, finish = 0.0, 0.0
    for _ in range(400):  # 400 x 0.25 MB = 100 MB requested at once
        _, finish = dev.read(t, int(0.25 * MB))
    # (100 MB - 2 MB burst) / 20 MB/s, plus the last read's own service time
    assert finish == pytest.approx(98 / 20 + 50e-6 + 0.25 / 2000, rel=1e-6)
    unthrottled = Device(latency_s=50e-6, bandwidth_bps=2000 * MB, queue_depth=4)
    for _ in range(400):
        _, f2 = unthrottled.read(0.0, int(0.25 * MB))
    assert f2 < 0.1


def test_iops_bucket_counts_requests():
    dev = Device(latency_s=0.0, bandwidth_bps=1e12, queue_depth=64)
    dev.throttle_requests = TokenBucket(rate=100, burst_s=0.1)  # 10-request burst
    last = [dev.read(0.0, 4096)[0] for _ in range(110)][-1]
    assert last == pytest.approx(1.0)
