"""How many requests a sampler keeps in flight to one source, and how fast after throttling.

The limit is a fixed number, or found (``auto``).

With a first-byte latency ``L``, a sampler that wants ``r`` objects per second needs about
``r * L`` requests in flight: 16 is plenty on loopback and far too few against a bucket 30 ms
away, and no fixed number fits both, nor a bucket that throttles. ``sampler.concurrency: auto``
(the default) finds the number per source and sampler process with `AutoConcurrency`:

* **start**: the limit doubles each *round* (about one round trip of requests) while goodput
  (bytes per second fetched) grows by at least `START_GAIN`;
* **hold**: then it holds, and every `HOLD_S` (doubling up to `HOLD_MAX_S` while
  probes fail) it *probes* a step higher (`PROBE_STEP`), keeping the step only if goodput
  grew by at least half of it, else going back: so it follows a link that got faster, and
  settles where more requests bring nothing (a busy CPU, the link's bandwidth, the limit on
  bytes in flight);
* **decrease**: a throttled answer (503 SlowDown, 429) or a timeout lowers it at once (at most
  once per round trip): a probe goes back to the limit that was fine; a timeout multiplies the
  limit by `DECREASE`; a throttled answer *paces* the source's requests (`Pace`, below). A
  limit that was throttled is remembered as a ceiling that later probes approach by halving
  the distance. So a throttled sampler settles just below the remote's rate instead of sawing
  between it and a fraction of it;
* the limit stays within ``[1, cap]``; the cap is ``sampler.max_bytes_in_flight`` over the mean
  object size (and at most `MAX_CONCURRENCY`).

A round ends once at least ``limit`` requests (and `MIN_ROUND_REQUESTS`) completed and
`MIN_ROUND_S` or two round trips passed. A round in which the requests in flight never
reached the limit says nothing about a higher one (the sampler could not supply more: the
bytes in flight, the CPU): the limit does not grow on it.

`FixedConcurrency` is an explicit ``concurrency: N``: the limit is N, always.

Both are driven by the request gate (`requests.RequestGate`): ``started()`` when a request goes
out, ``finished()`` with its outcome. They hold no lock: the gate calls them from one thread (the
IO loop) or under its own lock. Time is injected (``clock``) so that tests can simulate.

**The pace** of a throttled source (`Pace`): requests per second, one for all the samplers of a
daemon. A remote that answers ``503 SlowDown`` (or 429) has a rate; a window of requests in
flight is too coarse a way to keep to it (at 100 requests/s and 20 ms of latency, two in flight
ask for exactly the limit, one for half). So the first throttled answer *paces* the source's
requests: each waits for its instant (a GCRA, like `requests.RequestBudget`), and the pace moves
by AIMD on the rate:

* **decrease** (multiplicative): a throttled answer multiplies the pace by the share
  of answers that were not throttled since the last decrease, at most `PACE_DECREASE` and at
  least `PACE_DECREASE_MIN` (retries bunch up: a share measured over a quarter second swings),
  at most once per `PACE_HOLD_S` (a burst of 503s answers the requests sent before the last
  decrease could take effect). The first one starts from the rate that was
  getting through;
* **growth**: while the pace holds requests back it grows by `PACE_GROWTH` a second (at least
  `PACE_STEP_MIN` requests/s), the growth doubling every `PACE_DOUBLING_S` without a
  throttled answer (up to `PACE_GROWTH_MAX`): back at the remote's rate in well under a
  second after a decrease, a few 503s, and again; a pace left low (the remote's limit raised)
  catches up in seconds;
* a pace that held nothing back for `PACE_FORGET_S` is dropped: demand stayed below it.

The samplers of a daemon share one pace per source (`SharedPaceState`, a small file in
the cache directory, a `epochcache.paths.ClockFile`: under ``flock``, which the kernel releases when the process
holding it dies, and stamped with the clock its instants belong to, so the file of another
boot or host is started afresh): the remote's rate is shared by all of them, so a sampler that
has nothing to fetch leaves the whole rate to the others at once, and none is starved by
another's larger share. Tests and the simulation use `LocalPaceState`.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from ..paths import ClockFile

#: The most requests in flight per source and sampler process (``sampler.concurrency``'s range).
MAX_CONCURRENCY = 1024
#: Where ``auto`` starts.
START_LIMIT = 8
#: ``start`` doubles the limit while a round's goodput is at least this times the last one's
#: (half of the doubling: the rule of a probe, below).
START_GAIN = 1.5
#: A throttled answer or a timeout multiplies the limit by this (outside a probe).
DECREASE = 0.7
#: A probe raises the limit by this fraction (at least 1).
PROBE_STEP = 0.25
#: Rounds a probe is measured over.
PROBE_ROUNDS = 2
#: A probe is kept when goodput grew by at least this fraction of the limit's growth.
PROBE_KEEP = 0.5
#: Seconds between probes, doubling (up to the maximum) while probes fail.
HOLD_S, HOLD_MAX_S = 1.0, 16.0
#: A round lasts at least this long and this many requests (noise)...
MIN_ROUND_S = 0.05
MIN_ROUND_REQUESTS = 8
#: ... and a ceiling learnt from throttling is forgotten after this long without throttling.
CEILING_FORGET_S = 60.0


class Outcome(enum.IntEnum):
    """What became of one request."""

    OK = 0
    THROTTLED = 1  # 503 SlowDown, 429
    TIMEOUT = 2
    ERROR = 3  # anything else (not found, refused): says nothing about the rate


class Phase(enum.IntEnum):
    """Where `AutoConcurrency` is. START -> HOLD (goodput stopped growing, or a
    decrease); HOLD -> PROBE (a probe is due); PROBE -> PROBE (it paid: the next step) or
    HOLD (it did not, or it was throttled)."""

    START = 0
    HOLD = 1
    PROBE = 2


class FixedConcurrency:
    """An explicit ``sampler.concurrency: N``: N requests in flight at most, whatever happens;
    a throttled remote is still answered by a pace (`Pace`).

    Args:
        limit: requests in flight at most; at least 1.
        clock: seconds, monotonic (injected by tests).
        pacer: the source's pace after throttling (default: this process's own).
    """

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic,
                 pacer: Pace | None = None) -> None:
        if limit < 1:
            raise ValueError(f"concurrency: must be at least 1, got {limit}")
        self.limit = float(limit)
        self.cap = limit
        self.in_flight = 0
        self.throttled_at = float("-inf")
        self._clock = clock
        self.pacer = pacer if pacer is not None else Pace(clock=clock)
        self._since_ok = self._since_throttled = 0  # answers since the pace's last decrease
        self._rtt = 0.0  # smoothed latency of successful requests

    @property
    def slots(self) -> int:
        """Requests that may be in flight now."""
        return int(self.limit)

    @property
    def pace(self) -> float | None:
        """Requests per second after throttling (None: not paced)."""
        return self.pacer.rate

    def reserve(self) -> float:
        """Seconds the next request must wait for the pace (0 when not paced)."""
        return self.pacer.reserve()

    def started(self) -> None:
        self.in_flight += 1

    def finished(self, outcome: Outcome, nbytes: int = 0, latency_s: float = 0.0) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        self._answered(self._clock(), outcome, latency_s)

    def _answered(self, now: float, outcome: Outcome, latency_s: float) -> None:
        """Count an answer for the pace; a throttled one slows it."""
        if outcome == Outcome.OK:
            self._since_ok += 1
            self._rtt = latency_s if not self._rtt else 0.9 * self._rtt + 0.1 * latency_s
        elif outcome in (Outcome.THROTTLED, Outcome.TIMEOUT):
            self.throttled_at = now
            self._since_throttled += 1
            if outcome == Outcome.THROTTLED:
                answered = self._since_ok + self._since_throttled
                share = self._since_ok / answered if answered else 1.0
                if self.pacer.decrease(share, self._getting_through(now)):
                    self._since_ok = self._since_throttled = 0

    def _getting_through(self, now: float) -> float:
        """Requests per second getting through (the first pace): the window's most."""
        return self.slots / max(self._rtt, MIN_ROUND_S)

    def throttled_within(self, seconds: float, now: float) -> bool:
        """Whether a request was throttled (or timed out) in the ``seconds`` before ``now``."""
        return now - self.throttled_at < seconds


class AutoConcurrency(FixedConcurrency):
    """``sampler.concurrency: auto``: the limit found by the rules of the module docstring.

    Args:
        start: the first limit.
        cap: the highest limit (see `set_cap`).
        clock: seconds, monotonic (injected by tests).
        pacer: the source's pace after throttling (default: this process's own).
    """

    def __init__(self, start: int = START_LIMIT, cap: int = MAX_CONCURRENCY,
                 clock: Callable[[], float] = time.monotonic,
                 pacer: Pace | None = None) -> None:
        super().__init__(max(1, min(start, cap)), clock, pacer)
        self.cap = max(1, cap)
        self.phase = Phase.START
        now = clock()
        self._round_start, self._round_done, self._round_bytes = now, 0, 0
        self._round_peak = 0
        self._rounds: list[tuple[float, bool]] = []  # (goodput, window full) of this phase
        self._base_limit, self._base_rate = self.limit, 0.0
        self._ceiling: float | None = None
        self._ceiling_at = float("-inf")
        self._hold_since, self._hold_s = now, HOLD_S
        self._last_decrease = float("-inf")
        self._ok_rate = 0.0  # successful requests per second, of the last round
        # The round after a change of the limit (and the first) is not judged: its requests
        # went out under the old limit, or into an empty window.
        self._settling = True
        #: (time, limit) of the last changes, for status and tests
        self.changes: deque[tuple[float, float]] = deque([(now, self.limit)], maxlen=256)
        self.decreases = 0

    def set_cap(self, cap: int) -> None:
        """Lower or raise the highest limit (the bytes-in-flight limit over the mean object size)."""
        self.cap = max(1, min(MAX_CONCURRENCY, cap))
        if self.limit > self.cap:
            self._set(self.cap)

    # -- the gate's calls -------------------------------------------------------------------

    def started(self) -> None:
        if not self.in_flight:
            # nothing was in flight (the start, or the sampler had no work): a round that
            # spanned the gap would understate the rate
            self._new_round(self._clock())
            self._settling = True
        self.in_flight += 1
        if self.in_flight > self._round_peak:
            self._round_peak = self.in_flight

    def finished(self, outcome: Outcome, nbytes: int = 0, latency_s: float = 0.0) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        now = self._clock()
        self._answered(now, outcome, latency_s)  # the pace
        if outcome in (Outcome.THROTTLED, Outcome.TIMEOUT):
            # the window: once per round trip
            if now - self._last_decrease >= max(MIN_ROUND_S, 2 * self._rtt):
                self._decrease(now, outcome)
            return
        if outcome != Outcome.OK:
            return
        self._round_done += 1
        self._round_bytes += nbytes
        elapsed = now - self._round_start
        if (self._round_done >= max(MIN_ROUND_REQUESTS, self.slots)
                and elapsed >= max(MIN_ROUND_S, 2 * self._rtt)):
            # goodput in bytes/s; requests/s when the objects are empty
            rate = (self._round_bytes or self._round_done) / elapsed
            self._ok_rate = self._round_done / elapsed
            full = self._round_peak >= self.slots
            self._new_round(now)
            if self._settling:
                self._settling = False
            else:
                self._judge(now, rate, full)

    # -- decisions --------------------------------------------------------------------------

    def _new_round(self, now: float) -> None:
        self._round_start, self._round_done, self._round_bytes = now, 0, 0
        self._round_peak = self.in_flight

    def _set(self, limit: float) -> None:
        limit = max(1.0, min(float(self.cap), limit))
        if limit != self.limit:
            self.limit = limit
            self._settling = True
            self.changes.append((self._clock(), limit))

    def _hold(self, now: float) -> None:
        self.phase = Phase.HOLD
        self._rounds = []
        self._hold_since = now

    def _decrease(self, now: float, outcome: Outcome) -> None:
        self._last_decrease = now
        self.decreases += 1
        self._ceiling, self._ceiling_at = self.limit, now
        if self.phase == Phase.PROBE:
            self._set(self._base_limit)  # the step was too much: back to what was fine
        elif outcome == Outcome.TIMEOUT:
            self._set(self.limit * DECREASE)
            self._base_limit, self._base_rate = self.limit, 0.0
        self._hold_s = HOLD_S
        self._hold(now)
        self._new_round(now)

    def _getting_through(self, now: float) -> float:
        """The rate that was getting through: this round's so far, else the last round's."""
        elapsed = now - self._round_start
        rate = max(self._ok_rate, self._round_done / elapsed if elapsed >= MIN_ROUND_S else 0.0)
        return rate or super()._getting_through(now)

    def _judge(self, now: float, rate: float, full: bool) -> None:
        if self._ceiling is not None and now - self._ceiling_at > CEILING_FORGET_S:
            self._ceiling = None
        if self.phase == Phase.START:
            if not full:
                return  # the sampler did not fill the window: a larger one shows nothing
            if not self._base_rate or rate >= self._base_rate * START_GAIN:
                self._base_limit, self._base_rate = self.limit, rate
                if self.limit >= self.cap:
                    self._hold(now)
                else:
                    self._set(self.limit * 2)
            else:  # doubling did not pay: back to the last limit whose doubling did
                self._set(self._base_limit)
                self._hold(now)
            return
        self._rounds.append((rate, full))
        if self.phase == Phase.HOLD:
            if now - self._hold_since < self._hold_s or len(self._rounds) < PROBE_ROUNDS:
                return
            rates = [r for r, _ in self._rounds]
            self._base_limit, self._base_rate = self.limit, sum(rates) / len(rates)
            window_used = sum(f for _, f in self._rounds) * 2 >= len(self._rounds)
            if not window_used or self.limit >= self.cap or not self._probe(now):
                self._hold(now)  # nothing to probe: hold on
            return
        # PROBE
        if len(self._rounds) < PROBE_ROUNDS:
            return
        rate = sum(r for r, _ in self._rounds) / len(self._rounds)
        growth = self.limit / self._base_limit - 1
        if rate >= self._base_rate * (1 + PROBE_KEEP * growth):
            self._base_limit, self._base_rate = self.limit, rate
            self._hold_s = HOLD_S
            if self.limit >= self.cap or not self._probe(now):
                self._hold(now)
        else:
            self._set(self._base_limit)
            self._hold_s = min(HOLD_MAX_S, self._hold_s * 2)
            self._hold(now)

    def _probe(self, now: float) -> bool:
        """Raise the limit by a step (toward a remembered ceiling: half the distance); False
        when no step is left."""
        step = max(1.0, self.limit * PROBE_STEP)
        if self._ceiling is not None and self._ceiling > self.limit:
            step = max(1.0, min(step, (self._ceiling - self.limit) / 2))
        elif self._ceiling is not None:
            step = 1.0
        before = self.limit
        self._set(self.limit + step)
        if self.limit <= before:
            return False
        self.phase = Phase.PROBE
        self._rounds = []
        return True


# -------------------------------------------------------------------------------------------- pace

#: A throttled answer multiplies the pace by at most this, at least that...
PACE_DECREASE, PACE_DECREASE_MIN = 0.9, 0.7
#: ... at most once per this many seconds.
PACE_HOLD_S = 0.25
#: Growth per second while the pace holds requests back, its doubling time without a
#: throttled answer, and its most.
PACE_GROWTH, PACE_DOUBLING_S, PACE_GROWTH_MAX = 0.15, 2.0, 1.0
#: The least growth, and the lowest pace, in requests per second.
PACE_STEP_MIN = 0.5
#: A pace that held nothing back this long is dropped.
PACE_FORGET_S = 30.0

#: The state: [next free instant, pace (0: none), grown at, held back at, backed off at,
#: throttled at], in time.monotonic() seconds (one clock for every process of a boot).
_INITIAL = (0.0, 0.0, 0.0, float("-inf"), float("-inf"), float("-inf"))
_NAME = re.compile(r"[^A-Za-z0-9_.-]")


class PaceState(Protocol):
    def locked(self) -> contextlib.AbstractContextManager[list[float]]:
        """The state, to read and change; written back when the block ends."""


class LocalPaceState:
    """The state in this process (a single sampler, tests)."""

    def __init__(self) -> None:
        self._cells = list(_INITIAL)

    @contextlib.contextmanager
    def locked(self) -> Iterator[list[float]]:
        yield self._cells


class SharedPaceState:
    """The state in a file every sampler of a daemon maps (see the module docstring).

    Args:
        path: the file (created if missing).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._file = ClockFile(path, _INITIAL)

    @classmethod
    def in_cache(cls, cache_dir: str | os.PathLike[str], source: str) -> SharedPaceState:
        """The pace of ``source`` (its label) shared through ``cache_dir``."""
        return cls(Path(cache_dir) / f"pace-{_NAME.sub('_', source)}")

    def locked(self) -> contextlib.AbstractContextManager[list[float]]:
        return self._file.locked()

    def close(self) -> None:
        self._file.close()


class Pace:
    """A source's pace (see the module docstring).

    Args:
        state: where it is kept (default: this process only).
        clock: seconds, monotonic (injected by tests).
    """

    def __init__(self, state: PaceState | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._state = state if state is not None else LocalPaceState()
        self._clock = clock
        self._rate: float | None = None  # as last seen (status)

    @property
    def rate(self) -> float | None:
        """Requests per second, or None when not paced (as of this process's last look)."""
        return self._rate

    def reserve(self) -> float:
        """Seconds the next request must wait (0: now, or not paced); it is counted as sent at
        that instant."""
        now = self._clock()
        with self._state.locked() as cells:
            tat, rate, grown_at, held_at, _, throttled_at = cells
            if not rate:
                self._rate = None
                return 0.0
            start = max(tat, now)
            wait = start - now
            if wait > 0:  # it holds requests back: it grows, faster the longer nothing throttled
                elapsed = min(1.0, max(0.0, now - grown_at))
                doublings = (now - throttled_at) / PACE_DOUBLING_S
                growth = min(PACE_GROWTH_MAX, PACE_GROWTH * 2**doublings)
                rate += max(PACE_STEP_MIN, rate * growth) * elapsed
                held_at = now
            elif now - held_at > PACE_FORGET_S:
                cells[1] = 0.0  # demand stayed below it: the remote's rate is not the limit
                self._rate = None
                return 0.0
            cells[0], cells[1], cells[2], cells[3] = start + 1.0 / rate, rate, now, held_at
            self._rate = rate
        return wait

    def decrease(self, share: float, first: float) -> bool:
        """A throttled answer: the pace times ``share`` (the answers not throttled since this
        process's last decrease; bounded, see the module docstring), or ``first`` (the rate
        that was getting through) times that when not paced yet. False when a decrease was
        made less than `PACE_HOLD_S` ago (by any sampler)."""
        now = self._clock()
        with self._state.locked() as cells:
            cells[5] = now
            if now - cells[4] < PACE_HOLD_S:
                return False
            rate = cells[1] or first
            rate = max(PACE_STEP_MIN, rate * max(PACE_DECREASE_MIN, min(PACE_DECREASE, share)))
            cells[1], cells[2], cells[3], cells[4] = rate, now, now, now
            self._rate = rate
        return True
