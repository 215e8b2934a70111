"""Whether a run's wait for ``train.min_samples`` can still end, judged while it waits.

``epochcache run`` waits until the cache holds ``train.min_samples`` samples. It used to wait
forever when that could not happen. While it waits, `FillWatch` reads the daemon's state
documents in the cache (the daemon's heartbeat, each sampler's health) and ends the wait as
soon as the number is known to be out of reach:

* **the whole source is cached** and holds fewer samples (every sampler went a whole pass over
  its keys without anything new and without a failed fetch): training starts on what there is,
  with a warning -- waiting longer cannot add a sample, and min_samples exists so that
  training does not start on a small prefix of a larger dataset;
* **the daemon is gone** (its thread in this process ended, or no process holds the cache's
  daemon lock): [`MinSamplesUnreachable`][epochcache.MinSamplesUnreachable] with its exit status and
  the cause it recorded (e.g. a sampler that kept dying, and that sampler's last error);
* **every fetch has failed** for ``EPOCHCACHE_MIN_SAMPLES_FAILING_S`` seconds (default 60,
  read when the wait starts): no sample cached, no fetch succeeded, and fetches failed in that
  time -- the error names the last fetch error (403, 404, unreachable endpoint, ...).

A cache full at its capacity before reaching min_samples is `wait_for_samples`' own check.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from ..errors import MinSamplesUnreachable
from ..ingest.supervisor import DaemonLock
from ..store import SampleStore

log = logging.getLogger(__name__)

FAILING_ENV = "EPOCHCACHE_MIN_SAMPLES_FAILING_S"
DEFAULT_FAILING_S = 60.0


def failing_window_s() -> float:
    """How long every fetch must fail before the wait gives up (``EPOCHCACHE_MIN_SAMPLES_FAILING_S``)."""
    raw = os.environ.get(FAILING_ENV, "")
    try:
        return max(1.0, float(raw)) if raw else DEFAULT_FAILING_S
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %.0f", FAILING_ENV, raw,
                    DEFAULT_FAILING_S)
        return DEFAULT_FAILING_S


class FillWatch:
    """``watch(count)`` while waiting for ``min_samples``: True to start on what is cached, an
    exception when the number cannot be reached, False to keep waiting.

    Args:
        cache: the cache being filled.
        min_samples: the number waited for (``train.min_samples``).
        daemon_exit: for a daemon in this process, returns None while it runs, else how it
            ended (exit status and cause); None when the daemon is another process's.
        announce: warn about the node's cache (False: the node's other ranks, which would
            repeat the warning of local rank 0 word for word).
    """

    def __init__(self, cache: SampleStore, min_samples: int,
                 daemon_exit: Callable[[], str | None] | None = None,
                 announce: bool = True) -> None:
        self.cache, self.min_samples, self.daemon_exit = cache, min_samples, daemon_exit
        self.announce = announce
        self.window_s = failing_window_s()
        self._count = -1
        self._progress = time.time()  # the last time the count grew or a fetch succeeded

    def _unreachable(self, count: int, why: str) -> MinSamplesUnreachable:
        return MinSamplesUnreachable(
            f"{self.cache.path}: train.min_samples={self.min_samples} cannot be reached "
            f"({count} samples cached): {why}")

    def __call__(self, count: int) -> bool:
        now = time.time()
        if count > self._count:
            self._count, self._progress = count, now
        daemon = self.cache.tables.get_state("daemon") or {}
        self._check_daemon(count, daemon)
        # Health documents of this daemon's samplers only: those of an earlier daemon stay in
        # the cache until its successor's samplers write theirs.
        started = float(daemon.get("started") or 0)
        samplers: list[dict[str, Any]] = [
            s for s in (daemon.get("samplers") or {}).values()
            if float(s.get("started") or 0) >= started]
        current = bool(samplers) and len(samplers) == len(daemon.get("samplers") or {})
        if current and not daemon.get("stopped") and all(s.get("idle") == "complete"
                                                         for s in samplers):
            if count == 0:
                raise self._unreachable(count, "the samplers went through every key of the "
                                               "source and none could be cached (see the "
                                               "quarantine in `epochcache status`)")
            log.log(logging.WARNING if self.announce else logging.DEBUG,
                    "%s: the whole source (this node's share of it) is cached: %d samples, "
                    "fewer than train.min_samples=%d; training on what there is (lower "
                    "train.min_samples to silence this)", self.cache.path, count,
                    self.min_samples)
            return True
        last_ok = max((float(s.get("last_ok") or 0) for s in samplers), default=0.0)
        self._progress = max(self._progress, last_ok)
        failed = [s for s in samplers if float(s.get("last_failed") or 0) > self._progress]
        # ...or no read succeeded since (a key gone or refused is not asked for again, so no
        # fetch fails any more either): `ingest.feed`'s failing sources, in every sampler
        stuck = bool(samplers) and all(s.get("failing") for s in samplers)
        if (failed or stuck) and now - self._progress >= self.window_s:
            errors = "; ".join(sorted({
                str(s.get("last_error") or "?") for s in failed} | {
                str(entry.get("error") or "?") for s in samplers if stuck
                for entry in (s.get("failing") or {}).values()}))
            raise self._unreachable(
                count, f"every fetch has failed for {now - self._progress:.0f} s (last error: "
                       f"{errors}); check the source's URL, credentials and permissions")
        return False

    def _check_daemon(self, count: int, daemon: dict[str, Any]) -> None:
        if self.daemon_exit is not None:
            ended = self.daemon_exit()
            if ended is not None:
                raise self._unreachable(count, f"the daemon filling it stopped: {ended}")
            return
        if DaemonLock.is_held(self.cache.path):
            return
        if not daemon:
            raise self._unreachable(count, "no daemon is filling this cache; start "
                                           "`epochcache daemon CONFIG`")
        cause = daemon.get("failure") or ("it stopped" if daemon.get("stopped") else
                                          "it was killed (no process holds its lock)")
        age = time.time() - float(daemon.get("heartbeat") or 0)
        raise self._unreachable(
            count, f"the daemon that filled it (pid {daemon.get('pid')}, last heartbeat "
                   f"{age:.0f} s ago) is not running: {cause}; start `epochcache daemon CONFIG` "
                   "again")
