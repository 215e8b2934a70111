"""How a source's requests go out: the gate, the daemon's budget, the bandwidth limit, backoff.

**The request gate** (`RequestGate`): every object read of one source in one sampler process
passes through it. It keeps three promises, one request at a time:

* at most ``control.slots`` requests are in flight (`concurrency`: a fixed number, or
  ``auto``), shared by all the batches of the source being fetched; each request's outcome
  (bytes, throttled, timed out) goes back to the control, which moves the limit;
* requests wait for the control's pace (after throttling, `concurrency.Pace`) and for the
  daemon's shared budget (``sampler.max_requests_per_s``, `RequestBudget`) before they are sent;
* every request that reached the remote is counted, by kind (`health`): a GET, a HEAD;
  one that never left the process (a refused connection, a request its client would not
  build) is not, as the remote never saw it.

It also says how a throttled request is answered: it gives up its slot, waits a backoff
(`throttle_delay`, growing per attempt, jittered) and asks for the *same* object again,
until its deadline; throttling is a rate to adapt to, not a fault of the object, so it never
ends in quarantine (a request still throttled at its deadline fails like a transient error: the
object is fetched again on a later pass). A transient error's backoff is `backoff_delays`
(full jitter), which `remote.retry` and a layout's retries of failed objects wait by.

The asynchronous side (`RequestGate.enter`, `RequestGate.leave`) runs on fsspec's
IO loop, where all the source's requests of a process run; the synchronous side
(`RequestGate.enter_sync`) serves filesystems read from threads.

**The budget** (`RequestBudget`, ``sampler.max_requests_per_s``): a request budget shared by all
the samplers of a daemon. It is a token bucket in its GCRA form (one "theoretical arrival
time"), kept in a small file in the cache directory that every sampler process maps
(a `epochcache.paths.ClockFile`: under ``flock``, stamped with the clock its instant belongs to, so the file of
another boot or host is started afresh): a request reserves the next free instant and waits
until it comes, so the samplers together send at most the budget per second on average, with
bursts of `BURST_S` seconds' worth after a quiet spell. A reservation costs a few
microseconds. The budget counts every request the samplers send, retries included; a daemon's
listing pages are not counted (they are few, and made before sampling starts).

**The bandwidth limit** (`BandwidthLimiter`, ``sampler.bandwidth_limit``): a token bucket on
the bytes a sampler process reads.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..paths import ClockFile
from .concurrency import FixedConcurrency, Outcome
from .health import RequestStats

# ----------------------------------------------------------------------------------------- backoff

#: Backoff of a throttled request: the first wait, and the longest.
THROTTLE_BASE_S, THROTTLE_MAX_S = 0.1, 5.0


def throttle_delay(attempt: int) -> float:
    """Seconds to wait before asking again after the ``attempt``-th throttled answer (0-based):
    an exponential backoff with jitter over its upper half (never an immediate retry)."""
    cap = min(THROTTLE_MAX_S, THROTTLE_BASE_S * 2.0**attempt)
    return cap * (0.5 + 0.5 * random.random())


def backoff_delays(
    attempts: int, *, base_s: float = 0.2, max_s: float = 10.0,
    deadline_s: float | None = None, rng: random.Random | None = None,
) -> Iterator[float]:
    """The waits between ``attempts`` tries: ``attempts - 1`` full-jitter delays,
    uniform(0, min(max_s, base_s * 2**i)), ending early at the first wait that would end
    ``deadline_s`` seconds or more after this call (the tries give up then)."""
    rng = rng or random.Random()
    end = math.inf if deadline_s is None else time.monotonic() + deadline_s
    delays = (rng.uniform(0.0, min(max_s, base_s * (2**i))) for i in range(max(0, attempts - 1)))
    return itertools.takewhile(lambda delay: time.monotonic() + delay < end, delays)


# -------------------------------------------------------------------------------------------- gate

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


# ------------------------------------------------------------------------------------------ budget

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


# --------------------------------------------------------------------------------------- bandwidth

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
