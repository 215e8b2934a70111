"""What a sampler holds between fetching and committing, bounded in bytes as well as requests.

A sampler fetches several batches at once (`FETCH_DEPTH` or
more) while the committer writes another: with skewed object sizes (or tar shards of a GiB) a
bound on requests alone lets a sampler hold many GiB. Each batch reserves its expected bytes
before it is fetched (the listed or manifest size, else an estimate learnt from what was
fetched), the reservation is corrected to the real size once fetched, and released when the
batch is committed. A single object larger than the whole limit is still fetched, alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from .layouts import SampleRef


class InFlight:
    """Bytes reserved by the batches in flight, at most ``limit`` (one batch may exceed it alone).

    Args:
        limit: bytes a sampler may hold; positive.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"in-flight byte limit: must be positive, got {limit}")
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more may be reserved now (always, when nothing is reserved)."""
        with self._cond:
            return self.used == 0 or self.used + nbytes <= self.limit

    def wait(self, nbytes: int, should_stop: Callable[[], bool], poll_s: float = 0.25) -> bool:
        """Wait until ``nbytes`` fit; False if ``should_stop()`` turned true first."""
        with self._cond:
            while not (self.used == 0 or self.used + nbytes <= self.limit):
                if should_stop():
                    return False
                self._cond.wait(poll_s)
        return True

    def take(self, nbytes: int) -> None:
        with self._cond:
            self.used += nbytes

    def adjust(self, reserved: int, actual: int) -> None:
        """Replace a reservation of ``reserved`` bytes by the ``actual`` size fetched."""
        with self._cond:
            self.used += actual - reserved
            self._cond.notify_all()

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.used = max(0, self.used - nbytes)
            self._cond.notify_all()


class SizeEstimate:
    """The expected size of a ref: its listed size, else the mean of sizes seen so far.

    Until anything is known, an unknown size counts as ``unknown_bytes`` (a whole batch), so
    that the first batches of objects of unknown size are fetched one at a time.

    Args:
        sizes: listed sizes (of the listing's first keys: their mean seeds the estimate).
        unknown_bytes: what a ref of unknown size counts for before any size is known.
    """

    def __init__(self, sizes: Sequence[int] | np.ndarray, unknown_bytes: int) -> None:
        sizes = [int(size) for size in sizes if size and size > 0]
        self.total = float(sum(sizes))
        self.count = len(sizes)
        self.unknown_bytes = unknown_bytes

    @property
    def mean(self) -> int:
        return int(self.total / self.count) if self.count else self.unknown_bytes

    def of(self, ref: SampleRef) -> int:
        return int(ref.size) if ref.size else self.mean

    def observe(self, nbytes: int, count: int = 1) -> None:
        """Learn from ``count`` objects fetched with ``nbytes`` in all."""
        if count > 0:
            self.total += nbytes
            self.count += count
