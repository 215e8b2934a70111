"""The request gate: every object read of one source in one sampler process passes through it.

It keeps three promises, one request at a time:

* at most ``control.slots`` requests are in flight (`concurrency`: a fixed number, or
  ``auto``), shared by all the batches of the source being fetched; each request's outcome
  (bytes, throttled, timed out) goes back to the control, which moves the limit;
* requests wait for the control's pace (after throttling) and for the daemon's shared budget
  (``sampler.max_requests_per_s``, `budget`) before they are sent;
* every request that reached the remote is counted, by kind (`accounting`): a GET, a HEAD;
  one that never left the process (a refused connection, a request its client would not
  build) is not, as the remote never saw it.

It also says how a throttled request is answered: it gives up its slot, waits a backoff
(`throttle_delay`, growing per attempt, jittered) and asks for the *same* object again,
until its deadline; throttling is a rate to adapt to, not a fault of the object, so it never
ends in quarantine (a request still throttled at its deadline fails like a transient error: the
object is fetched again on a later pass).

The asynchronous side (`RequestGate.enter`, `RequestGate.leave`) runs on fsspec's
IO loop, where all the source's requests of a process run; the synchronous side
(`RequestGate.enter_sync`) serves filesystems read from threads.
"""

from __future__ import annotations

import asyncio
import collections
import random
import threading
import time

from .accounting import RequestStats
from .budget import RequestBudget
from .concurrency import FixedConcurrency, Outcome

#: Backoff of a throttled request: the first wait, and the longest.
THROTTLE_BASE_S, THROTTLE_MAX_S = 0.1, 5.0


def throttle_delay(attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait before asking again after the ``attempt``-th throttled answer (0-based):
    an exponential backoff with jitter over its upper half (never an immediate retry)."""
    cap = min(THROTTLE_MAX_S, THROTTLE_BASE_S * 2.0**attempt)
    return cap * (0.5 + 0.5 * (rng or random).random())


class RequestGate:
    """The gate of one source in one process (see the module docstring).

    Args:
        control: the concurrency control (fixed or auto).
        stats: where requests are counted (a private one if None).
        budget: the daemon's shared request budget, if any.
    """

    def __init__(self, control: FixedConcurrency, stats: RequestStats | None = None,
                 budget: RequestBudget | None = None) -> None:
        self.control = control
        self.stats = stats if stats is not None else RequestStats()
        self.budget = budget
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._lock = threading.Lock()  # the synchronous side: calls from several threads

    @property
    def slots(self) -> int:
        return self.control.slots

    # -- asynchronous: on the IO loop ----------------------------------------------------------

    async def enter(self, retry: bool = False) -> float:
        """Wait for a slot, the pace and the budget; returns when the request may go (its start
        time, ``time.monotonic()``). ``retry``: the request asks for an object again."""
        control = self.control
        while control.in_flight >= control.slots:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if not waiter.cancelled():
                    self._wake()  # pass the wake-up on: this one will not use it
                raise
        control.started()
        delay = control.reserve()
        if self.budget is not None:
            delay = max(delay, self.budget.reserve())
        if delay > 0:
            await asyncio.sleep(delay)
        return time.monotonic()

    def leave(self, started: float, outcome: Outcome, nbytes: int = 0, *, sent: bool = True,
              retry: bool = False, kind: str = "gets", streamed: bool = False) -> None:
        """A request entered at ``started`` ended with ``outcome``, having received ``nbytes``.

        Args:
            sent: whether it reached the remote (`remote.reached_remote`); only then is
                it counted, under ``kind`` (``gets``, ``heads``).
            retry: it asked for an object again.
            streamed: the body's bytes were counted as they arrived (`received`).
        """
        self.control.finished(outcome, nbytes, time.monotonic() - started)
        self._count(outcome, 0 if streamed else nbytes, sent, retry, kind)
        self._wake()

    def _wake(self) -> None:
        free = self.control.slots - self.control.in_flight
        while free > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                free -= 1

    # -- synchronous: from threads -------------------------------------------------------------

    def enter_sync(self, retry: bool = False) -> float:
        """`enter` for a request made from a thread (the caller bounds the threads)."""
        with self._lock:
            self.control.started()
            delay = self.control.reserve()
        if self.budget is not None:
            delay = max(delay, self.budget.reserve())
        if delay > 0:
            time.sleep(delay)
        return time.monotonic()

    def leave_sync(self, started: float, outcome: Outcome, nbytes: int = 0, *,
                   sent: bool = True, retry: bool = False, kind: str = "gets",
                   streamed: bool = False) -> None:
        """`leave` for a request made from a thread."""
        with self._lock:
            self.control.finished(outcome, nbytes, time.monotonic() - started)
        self._count(outcome, 0 if streamed else nbytes, sent, retry, kind)

    def received(self, nbytes: int) -> None:
        """Bytes of a streamed body (a tar shard), counted as they arrive: a shard of a GB
        takes minutes, and an epoch's egress is what arrived during it."""
        self.stats.add(bytes=nbytes)

    # -- counting ------------------------------------------------------------------------------

    def _count(self, outcome: Outcome, nbytes: int, sent: bool, retry: bool, kind: str) -> None:
        if sent:
            self.stats.add(**{kind: 1, "retries": int(retry)})
        if outcome == Outcome.OK:
            self.stats.add(bytes=nbytes)
        elif outcome == Outcome.THROTTLED:
            self.stats.add(throttled=1)
        elif outcome == Outcome.TIMEOUT:
            self.stats.add(timeouts=1)
        else:
            self.stats.add(errors=1)

    def publish(self) -> None:
        """Copy the control's gauges (limit, pace) into the stats."""
        self.stats.set(concurrency=self.control.slots, pace=round(self.control.pace or 0.0, 1))
