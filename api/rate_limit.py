"""Requests per token: a token bucket per token, refilled at ``rate_per_s`` up to
``burst``; a request finding it empty is answered 429 with Retry-After. Each API
replica counts its own requests."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable


class RateLimiter:
    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate_per_s, burst, clock
        self._buckets: dict[int, tuple[float, float]] = {}
        """token id -> (tokens left, when last refilled)"""
        self._lock = threading.Lock()

    def wait_s(self, key: int) -> float:
        """0 when the request may go on (and it is counted), else the seconds until it may."""
        with self._lock:
            now = self.clock()
            left, then = self._buckets.get(key, (float(self.burst), now))
            left = min(float(self.burst), left + (now - then) * self.rate)
            if left >= 1.0:
                self._buckets[key] = (left - 1.0, now)
                return 0.0
            self._buckets[key] = (left, now)
            return (1.0 - left) / self.rate if self.rate > 0 else math.inf
