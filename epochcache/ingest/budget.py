"""``sampler.max_requests_per_s``: a request budget shared by all the samplers of a daemon.

The budget is a token bucket in its GCRA form (one "theoretical arrival time"), kept in a
small file in the cache directory that every sampler process maps: a request reserves the next
free instant and waits until it comes, so the samplers together send at most the budget per
second on average, with bursts of `BURST_S` seconds' worth after a quiet spell. The file
is updated under ``flock``, which the kernel releases when its holder dies: a sampler killed
with ``kill -9`` in the middle cannot wedge the others (a process-shared lock would stay held
forever). A reservation costs a few microseconds.

The budget counts every request the samplers send, retries included; a daemon's listing pages
are not counted (they are few, and made before sampling starts).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from pathlib import Path

#: The bucket holds this many seconds of requests.
BURST_S = 0.25
#: The file in the cache directory.
BUDGET_FILE = "request-budget"
_LAYOUT = struct.Struct("<d")  # the next free instant, in time.monotonic() seconds


class RequestBudget:
    """At most ``per_s`` requests a second, for all the processes that open ``path``.

    ``time.monotonic()`` is the same clock in every process of a host, so the instant kept in
    the file means the same to all of them.

    Args:
        path: the shared file (created if missing).
        per_s: requests per second; positive.
    """

    def __init__(self, path: str | os.PathLike[str], per_s: float) -> None:
        if per_s <= 0:
            raise ValueError(f"sampler.max_requests_per_s: must be positive, got {per_s!r}")
        self.per_s = float(per_s)
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _LAYOUT.size:
                os.ftruncate(fd, _LAYOUT.size)
            self._map = mmap.mmap(fd, _LAYOUT.size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    @classmethod
    def in_cache(cls, cache_dir: str | os.PathLike[str], per_s: float) -> RequestBudget:
        """The budget shared through ``cache_dir``."""
        return cls(Path(cache_dir) / BUDGET_FILE, per_s)

    def reserve(self) -> float:
        """Reserve one request; the seconds to wait before sending it (0: now)."""
        now, start = self.reserve_at()
        return max(0.0, start - now)

    def reserve_at(self) -> tuple[float, float]:
        """Reserve one request: ``(now, the instant it may go)`` in ``time.monotonic()``."""
        interval = 1.0 / self.per_s
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            now = time.monotonic()
            (tat,) = _LAYOUT.unpack_from(self._map)
            # A file left by a process of an earlier boot holds an instant of another clock.
            if not tat or tat - now > 3600:
                tat = now
            start = max(tat, now - BURST_S)
            _LAYOUT.pack_into(self._map, 0, start + interval)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return now, start

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    def __repr__(self) -> str:
        return f"RequestBudget(per_s={self.per_s:g})"
