"""The kernel's block-I/O read throttle, as the device sees it: a token bucket in front of the
queue (engine.throttle sets the real one). Bytes (and, for an IOPS limit, requests) accrue at
the rate up to a burst of `burst_s` seconds' worth; a request passes at once when the bucket
holds it, else it waits for the missing tokens. Requests pass in arrival order (the throttle
queues bios FIFO per cgroup).

So demand below the rate passes at full device speed, and only demand above it is held to the
rate: what machine-notes measured (on-demand decode at ~43 MB/s of cold reads barely slowed
under a 50 MB/s throttle, and fell by half under 20 MB/s)."""

from __future__ import annotations

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


def admitted(now: float, nbytes: int, requests: int, throttle_bytes: TokenBucket | None,
             throttle_requests: TokenBucket | None) -> float:
    """When a read of `nbytes` in `requests` arriving at `now` passes the throttle's buckets."""
    passed = now
    if throttle_bytes is not None:
        passed = throttle_bytes.admit(passed, nbytes)
    if throttle_requests is not None:
        passed = throttle_requests.admit(passed, requests)
    return passed
