"""``sampler.max_requests_per_s``: a request budget shared by all the samplers of a daemon.

The budget is a token bucket in its GCRA form (one "theoretical arrival time"), kept in a
small file in the cache directory that every sampler process maps (`clockfile`: under
``flock``, stamped with the clock its instant belongs to, so the file of another boot or host is
started afresh): a request reserves the next free instant and waits until it comes, so the
samplers together send at most the budget per second on average, with bursts of `BURST_S`
seconds' worth after a quiet spell. A reservation costs a few microseconds.

The budget counts every request the samplers send, retries included; a daemon's listing pages
are not counted (they are few, and made before sampling starts).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .clockfile import ClockFile

#: The bucket holds this many seconds of requests.
BURST_S = 0.25
#: The file in the cache directory.
BUDGET_FILE = "request-budget"


class RequestBudget:
    """At most ``per_s`` requests a second, for all the processes that open ``path``.

    The file holds one cell: the next free instant, in ``time.monotonic()`` seconds (0: none).

    Args:
        path: the shared file (created if missing).
        per_s: requests per second; positive.
    """

    def __init__(self, path: str | os.PathLike[str], per_s: float) -> None:
        if per_s <= 0:
            raise ValueError(f"sampler.max_requests_per_s: must be positive, got {per_s!r}")
        self.per_s = float(per_s)
        self.path = Path(path)
        self._file = ClockFile(self.path, [0.0])

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
        with self._file.locked() as cells:
            now = time.monotonic()
            start = max(cells[0] or now, now - BURST_S)
            cells[0] = start + interval
        return now, start

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RequestBudget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RequestBudget(per_s={self.per_s:g})"
