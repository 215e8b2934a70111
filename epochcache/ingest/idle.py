"""When a feed has nothing to fetch: it rests at a cost that does not grow with its keys.

A feed's pass over its keys that brings nothing new (every key cached, quarantined or failing)
used to be followed by another pass a second later, forever: a scan of the whole key space
per second (8% of a core per sampler at 20k keys, linear in keys). Now such a feed is *idle*
and does no scan until something may have changed:

* **retry**: keys whose fetch failed in the pass (at most `FAILED_MAX`; more, and the
  whole pass is retried) are fetched again alone, after `RETRY_FIRST_S` doubling to
  `RETRY_MAX_S`, until a round of them fails nowhere;
* **idle**: once nothing failed, the feed waits. It looks, every `CHECK_S`, at one
  counter of the cache, the samples removed from it (evicted or repaired away: ``inserted -
  samples``), and the sampler tells it when its listing changed. Either wakes a new pass. As
  a safety net (keys deleted some other way) it also rescans after `RESCAN_FIRST_S`,
  doubling to `RESCAN_MAX_S` while nothing is found.

So an idle sampler reads one counter a second, whatever the size of its listing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

log = logging.getLogger(__name__)

#: How often an idle feed reads the cache's removal counter.
CHECK_S = 1.0
#: Failed keys are fetched again after this long, doubling up to the maximum.
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 300.0
#: An idle feed rescans its keys after this long anyway, doubling up to the maximum.
RESCAN_FIRST_S, RESCAN_MAX_S = 60.0, 3600.0
#: Failed keys remembered per pass; past this, the whole pass is retried instead.
FAILED_MAX = 65536

Mode = Literal["scan", "retry", "idle"]


class IdleState:
    """The rest of one feed (see the module docstring). The feed drives it: `round_over`
    when a pass (or a round of retries) brought nothing new, `changed` while idle,
    `wake` to scan again.

    Args:
        removed: reads the cache's count of removed samples (one read transaction).
    """

    def __init__(self, removed: Callable[[], int]) -> None:
        self.mode: Mode = "scan"
        self._removed = removed
        self._baseline = 0
        self._check_at = 0.0
        self.until = 0.0  # the feed takes nothing before this (monotonic seconds)
        self.retry_s = RETRY_FIRST_S
        self.rescan_s = RESCAN_FIRST_S
        self.failed: set[int] = set()  # listing indices whose fetch failed in this round
        self.overflow = False  # more failed than FAILED_MAX in this round
        self.queue: list[int] = []  # retry mode: the failed keys of the last round
        self.full_pass = False  # retry mode: too many failed, the whole pass is retried

    def note_failed(self, index: int) -> None:
        """A key's fetch failed (not corrupt: it is worth trying again later)."""
        if len(self.failed) < FAILED_MAX:
            self.failed.add(index)
        else:
            self.overflow = True

    def take_retries(self, count: int) -> list[int]:
        """Up to ``count`` failed keys to fetch again (retry mode)."""
        taken, self.queue = self.queue[:count], self.queue[count:]
        return taken

    def round_over(self, now: float) -> Mode:
        """A pass or a round of retries brought nothing new: rest, to retry what failed, else
        idle. Returns the new mode."""
        if self.failed or self.overflow:
            self.mode = "retry"
            self.until = now + self.retry_s
            self.retry_s = min(RETRY_MAX_S, 2 * self.retry_s)
            self.full_pass = self.overflow
            self.queue = [] if self.overflow else sorted(self.failed)
        else:
            self.mode = "idle"
            self.until = now + self.rescan_s
            self.rescan_s = min(RESCAN_MAX_S, 2 * self.rescan_s)
            self._baseline = self._removed()
            self._check_at = now + CHECK_S
        self.failed, self.overflow = set(), False
        return self.mode

    def changed(self, now: float) -> bool:
        """Idle mode: whether a new pass is due (samples were removed from the cache, or the
        safety interval passed). Reads the counter at most every `CHECK_S`."""
        if now >= self.until:
            return True
        if now < self._check_at:
            return False
        self._check_at = now + CHECK_S
        if self._removed() == self._baseline:
            return False
        self.rescan_s = RESCAN_FIRST_S  # the cache turns over: look again soon next time
        return True

    def wake(self) -> None:
        """Scan again (the listing changed, samples were removed, or a full retry is due)."""
        self.mode, self.until, self.queue, self.full_pass = "scan", 0.0, [], False

    def brought(self) -> None:
        """A batch brought new samples: the next failures are retried soon again."""
        self.retry_s = RETRY_FIRST_S
