"""What each source cost in requests and egress, counted where the requests are made.

Every remote request of a source passes through its request gate (`requests`) or its
listing (`paging`), which count it here, per source and per process:

* ``gets``: object reads the remote received (throttled ones included: the remote answered
  them; a tar shard read in several requests counts each; one that never left the process,
  such as a refused connection, not at all);
* ``heads``: object or bucket metadata requests (a brace pattern's first shard, the region of
  a bucket read with obstore);
* ``lists``: listing pages asked for (the daemon's listings and re-listings);
* ``bytes``: bytes received in object bodies (egress, as the remote bills it);
* ``throttled``: answers of 503 SlowDown or 429; ``timeouts``; ``errors``: other failures;
* ``retries``: requests sent again for the same object (after throttling or a transient error);
* ``concurrency``: requests the sampler allows in flight now (``auto`` moves it), and
  ``pace``: requests per second it keeps to after throttling (0: not paced).

A sampler keeps its counters in its health document (``sampler/<i>`` in the cache's state,
written with its commits, about twice a second) and the daemon its listings' in its own
(``daemon``); they start from what the document held, so they go on across restarts. Summed,
they are what ``status`` (``requests``), the Prometheus metrics (``epochcache_remote_*``) and a
run's per-epoch log show (`health.request_totals`). A process killed
with ``kill -9`` loses the counts of its last half second.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

#: The counters (monotonic), in the order status shows them.
COUNTERS = ("gets", "heads", "lists", "bytes", "throttled", "timeouts", "errors", "retries")
#: The gauges (the value now; summed over processes).
GAUGES = ("concurrency", "pace")


class RequestStats:
    """The request counters of one source in one process (thread-safe).

    Args:
        saved: counters saved by an earlier process (they go on from there).
    """

    def __init__(self, saved: Mapping[str, Any] | None = None) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, float] = dict.fromkeys(COUNTERS + GAUGES, 0)
        for name in COUNTERS:
            try:
                self.values[name] = int((saved or {}).get(name, 0))
            except (TypeError, ValueError):
                pass  # a document of another version: start from 0

    def add(self, **counts: int) -> None:
        """Add to counters, e.g. ``add(gets=1, bytes=65536)``."""
        with self._lock:
            for name, count in counts.items():
                self.values[name] += count

    def set(self, **gauges: float) -> None:
        with self._lock:
            self.values.update(gauges)

    def __getitem__(self, name: str) -> float:
        return self.values[name]

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return dict(self.values)

    def __repr__(self) -> str:
        return f"RequestStats({self.as_dict()})"


def source_label(name: str) -> str:
    """The key a source's counters are kept under: its ``sources:`` name, or ``source`` for
    the single ``source:`` section."""
    return name or "source"


def saved_requests(doc: Mapping[str, Any] | None, label: str) -> Mapping[str, Any] | None:
    """A source's counters in a saved health or daemon document (None when absent)."""
    requests = (doc or {}).get("requests")
    if not isinstance(requests, Mapping):
        return None
    found = requests.get(label)
    return found if isinstance(found, Mapping) else None
