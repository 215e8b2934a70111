"""How many requests a sampler keeps in flight to one source: a fixed number, or found (``auto``).

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
  limit by `DECREASE`; a throttled answer *paces* the source's requests (`pace`:
  AIMD on the rate, shared by the daemon's samplers: a remote that throttles at 100 requests/s
  with 20 ms of latency needs two requests in flight, a window too coarse to settle on). A
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

Both are driven by the request gate (`gate`): ``started()`` when a request goes out,
``finished()`` with its outcome. They hold no lock: the gate calls them from one thread (the
IO loop) or under its own lock. Time is injected (``clock``) so that tests can simulate.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable

from .pace import Pace

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
    a throttled remote is still answered by a pace (`pace`).

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

    def throttled_within(self, seconds: float, now: float | None = None) -> bool:
        """Whether a request was throttled (or timed out) in the last ``seconds``."""
        now = self._clock() if now is None else now
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
