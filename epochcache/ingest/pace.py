"""The pace of a throttled source: requests per second, one for all the samplers of a daemon.

A remote that answers ``503 SlowDown`` (or 429) has a rate; a window of requests in flight is
too coarse a way to keep to it (at 100 requests/s and 20 ms of latency, two in flight ask for
exactly the limit, one for half). So the first throttled answer *paces* the source's requests:
each waits for its instant (a GCRA, like `budget`), and the pace moves by AIMD on the rate:

* **decrease** (multiplicative): a throttled answer multiplies the pace by the share
  of answers that were not throttled since the last decrease, at most `DECREASE` and at
  least `DECREASE_MIN` (retries bunch up: a share measured over a quarter second swings), at most once per `HOLD_S` (a burst of 503s answers the requests sent
  before the last decrease could take effect). The first one starts from the rate that was
  getting through;
* **growth**: while the pace holds requests back it grows by `GROWTH` a second (at least
  `STEP_MIN` requests/s), the growth doubling every `DOUBLING_S` without a
  throttled answer (up to `GROWTH_MAX`): back at the remote's rate in well under a
  second after a decrease, a few 503s, and again; a pace left low (the remote's limit raised)
  catches up in seconds;
* a pace that held nothing back for `FORGET_S` is dropped: demand stayed below it.

The samplers of a daemon share one pace per source (`SharedPaceState`, a small file in
the cache directory, `clockfile`: under ``flock``, which the kernel releases when the process
holding it dies, and stamped with the clock its instants belong to, so the file of another
boot or host is started afresh): the remote's rate is shared by all of them, so a sampler that has nothing to
fetch leaves the whole rate to the others at once, and none is starved by another's larger
share. Tests and the simulation use `LocalPaceState`.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from .clockfile import ClockFile

#: A throttled answer multiplies the pace by at most this, at least that...
DECREASE, DECREASE_MIN = 0.9, 0.7
#: ... at most once per this many seconds.
HOLD_S = 0.25
#: Growth per second while the pace holds requests back, its doubling time without a
#: throttled answer, and its most.
GROWTH, DOUBLING_S, GROWTH_MAX = 0.15, 2.0, 1.0
#: The least growth, and the lowest pace, in requests per second.
STEP_MIN = 0.5
#: A pace that held nothing back this long is dropped.
FORGET_S = 30.0

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
                growth = min(GROWTH_MAX, GROWTH * 2 ** ((now - throttled_at) / DOUBLING_S))
                rate += max(STEP_MIN, rate * growth) * elapsed
                held_at = now
            elif now - held_at > FORGET_S:
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
        made less than `HOLD_S` ago (by any sampler)."""
        now = self._clock()
        with self._state.locked() as cells:
            cells[5] = now
            if now - cells[4] < HOLD_S:
                return False
            rate = cells[1] or first
            rate = max(STEP_MIN, rate * max(DECREASE_MIN, min(DECREASE, share)))
            cells[1], cells[2], cells[3], cells[4] = rate, now, now, now
            self._rate = rate
        return True
