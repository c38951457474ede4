"""Read throttles in front of the device queue, two kinds (Hardware.throttle_kind):

blk-throttle  Linux's block-I/O throttle (cgroup v1 blkio.throttle.read_*_device, v2 io.max;
              engine.throttle sets it for this project's throttled runs). Time is cut into
              slices of `slice_s` (throtl_slice, 100 ms): the allowance is the rate times the
              time since the slice started ROUNDED UP to whole slices, so a whole slice's bytes
              are granted at its start. A request that fits passes at once, at device speed;
              one that does not waits for the end of the current slice plus the time its
              excess takes at the rate (block/blk-throttle.c, tg_within_bps_limit). So an
              engine that reads faster than the rate reads a slice's worth at full speed and
              then stalls until the next slice: a long wait every few decode steps, the rest at
              device speed (the 15 MB/s traces of reports/validation show it).
token-bucket  a bucket that refills continuously up to a burst of `burst_s` seconds' worth
              (a cloud disk's burst credits): after the burst every request waits just for its
              own tokens, so the same average rate is spread over every read.

Requests pass in arrival order (the throttle queues bios FIFO per cgroup). Demand below the rate
passes at full device speed either way, and only demand above it is held to the rate: what
machine-notes measured (on-demand decode barely slowed under a throttle above its cold-read
rate, and fell by half under one well below it)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class TokenBucket:
    rate: float  # tokens per second (bytes/s, or requests/s)
    burst_s: float = 0.1  # bucket size in seconds of rate (engine.throttle.BURST_S)
    _level: float = -1.0  # tokens now; starts full
    _at: float = 0.0  # time of _level
    _last: float = 0.0  # last pass time (FIFO)

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst_s < 0:
            raise ValueError("token bucket rate must be > 0 and burst >= 0")
        if self._level < 0:
            self._level = self.rate * self.burst_s

    @property
    def capacity(self) -> float:
        return self.rate * self.burst_s

    def admit(self, t: float, tokens: float) -> float:
        """When a request of `tokens` arriving at `t` passes the throttle."""
        t = max(t, self._last)
        level = min(self.capacity, self._level + self.rate * (t - self._at))
        if level >= tokens:
            start, level = t, level - tokens
        else:
            start, level = t + (tokens - level) / self.rate, 0.0
        self._level, self._at, self._last = level, start, start
        return start


@dataclass
class SliceThrottle:
    """blk-throttle (see the module doc). Its slice starts afresh at a request that finds the
    last slice over and nothing queued (unused allowance is lost); while busy, whole slices
    behind the last dispatch are trimmed off (their allowance and what they dispatched), as
    throtl_trim_slice does. Jiffies are not modelled (time is continuous)."""

    rate: float  # tokens per second (bytes/s, or requests/s)
    slice_s: float = 0.1  # throtl_slice (engine.throttle.BURST_S)
    _start: float = -1.0  # the current slice's start (< 0: none yet)
    _end: float = -1.0  # when the slice counts as used (extended by each request)
    _disp: float = 0.0  # tokens dispatched since _start
    _last: float = 0.0  # last pass time (FIFO)

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.slice_s <= 0:
            raise ValueError("throttle rate and slice must be > 0")

    def admit(self, t: float, tokens: float) -> float:
        """When a request of `tokens` arriving at `t` passes the throttle."""
        queued = t < self._last  # an earlier request still waits: the slice goes on
        t = max(t, self._last)
        s = self.slice_s
        if self._start < 0 or (t > self._end and not queued):
            self._start, self._disp = t, 0.0
        elapsed = t - self._start
        whole = max(1, math.ceil(elapsed / s - 1e-9)) * s  # rounded up to whole slices
        excess = self._disp + tokens - self.rate * whole
        passes = t if excess <= 0 else t + excess / self.rate + (whole - elapsed)
        self._disp += tokens
        self._end = max(self._end, passes + s)  # each request extends the slice past itself
        done = math.floor((passes - self._start) / s + 1e-9)  # trim whole slices behind
        if done > 0:
            self._disp = max(0.0, self._disp - self.rate * s * done)
            self._start += done * s
        self._last = passes
        return passes


Throttle = TokenBucket | SliceThrottle
THROTTLE_KINDS = ("blk-throttle", "token-bucket")


def make_throttle(kind: str, rate: float, window_s: float) -> Throttle:
    """`window_s`: blk-throttle's slice, or the token bucket's burst."""
    if kind == "blk-throttle":
        return SliceThrottle(rate, window_s)
    if kind == "token-bucket":
        return TokenBucket(rate, window_s)
    raise ValueError(f"throttle kind must be one of {', '.join(THROTTLE_KINDS)}, got {kind!r}")


def admitted(now: float, nbytes: int, requests: int, throttle_bytes: Throttle | None,
             throttle_requests: Throttle | None) -> float:
    """When a read of `nbytes` in `requests` arriving at `now` passes the throttle's buckets."""
    passed = now
    if throttle_bytes is not None:
        passed = throttle_bytes.admit(passed, nbytes)
    if throttle_requests is not None:
        passed = throttle_requests.admit(passed, requests)
    return passed
