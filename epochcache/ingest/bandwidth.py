"""``sampler.bandwidth_limit``: a token bucket on the bytes a sampler process reads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BandwidthLimiter:
    """Token bucket shared by the threads of one process: ``consume(n)`` sleeps to keep the average
    rate at ``bytes_per_s``.

    The bucket holds at most ``burst_s`` seconds of tokens. Sizes are known only after a fetch, so
    the bucket may go into debt, and the next caller waits it off; the long-run rate still holds.

    Args:
        bytes_per_s: the average rate to keep; must be positive.
        burst_s: seconds of traffic that may pass at full speed after an idle period.
    """

    def __init__(self, bytes_per_s: float, *, burst_s: float = 1.0) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"bandwidth limit: must be positive bytes/s, got {bytes_per_s!r}")
        self.bytes_per_s = float(bytes_per_s)
        self._capacity = self.bytes_per_s * burst_s
        self._tokens = self._capacity
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def consume(self, num_bytes: int, *, sleep: Callable[[float], None] = time.sleep) -> float:
        """Take ``num_bytes`` from the bucket, sleeping while it is in debt; return the seconds slept."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._capacity, self._tokens + (now - self._last) * self.bytes_per_s)
            self._last = now
            self._tokens -= num_bytes
            wait = -self._tokens / self.bytes_per_s if self._tokens < 0 else 0.0
        if wait > 0:
            sleep(wait)
        return wait

    def __repr__(self) -> str:
        return f"BandwidthLimiter(bytes_per_s={self.bytes_per_s:.0f})"
