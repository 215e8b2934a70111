"""What ``epochcache run`` checks before it trains: its own sources, and that the wait for
``train.min_samples`` can end.

**A run trains on its own sources** (`check_run_sources`, before it starts or attaches a
daemon). ``epochcache run`` attaches to the daemon filling ``cache.dir`` when there is one, and
trains on whatever the cache holds: a run configured for dataset B trained on dataset A's
samples when A's daemon filled the directory, or had filled it before. So before anything
starts, the run compares its sources with the cache's (`epochcache.ingest.lineage`: what decides
which objects are read, not credentials, names or weights):

* a daemon filling the cache now must fill it from exactly the run's sources (the run would
  not start its own: nothing else would ever be fetched);
* every sample the cache holds must come from one of the run's sources (its origin names the
  listing it was picked from). Samples with no recorded origin (put through the Python API,
  or cached by a version before origins) cannot be judged, and are let through with a line
  in the log.

Otherwise the run refuses to start (a `ConfigError`: exit 2) naming both and saying how to
proceed, unless ``train.allow_other_sources: true`` says that is what the user wants.

**The wait for ``train.min_samples`` ends** (`FillWatch`, judged while it waits; the run used
to wait forever when the number could not be reached). While the run waits, `FillWatch` reads
the daemon's state documents in the cache (the daemon's heartbeat, each sampler's health) and
ends the wait as soon as the number is known to be out of reach:

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

from ..config import EpochcacheConfig
from ..errors import ConfigError, MinSamplesUnreachable
from ..ingest.lineage import cached_sources, config_sources, daemon_sources, describe, is_among
from ..ingest.supervisor import DaemonLock
from ..store import SampleStore

log = logging.getLogger(__name__)

ALLOW = "train.allow_other_sources"


def check_run_sources(config: EpochcacheConfig) -> None:
    """Refuse a run whose sources differ from its cache's (see the module docstring).

    Raises:
        ConfigError: the daemon filling ``cache.dir`` has other sources, or the cache holds
            samples of a source the run does not have; the message names both and what to do.
    """
    cache_dir = str(config.cache.dir)
    allowed = config.train.allow_other_sources
    ours = config_sources(config)
    pid, theirs = daemon_sources(cache_dir) or (0, None)
    if theirs is not None:
        if {source.identity for source in theirs} != {source.identity for source in ours}:
            problem = (f"cache.dir {cache_dir}: the daemon filling it (pid {pid}) fills it from "
                       f"{describe(theirs)}, but this run's sources are {describe(ours)}")
            if not allowed:
                raise ConfigError(f"{problem}; give this run a cache.dir of its own, or stop "
                                  f"that daemon, or set {ALLOW}: true to train on what it "
                                  "fills")
            log.warning("%s: training on what it fills (%s: true)", problem, ALLOW)
    if not os.path.exists(os.path.join(cache_dir, "data.mdb")):
        return  # a new cache: this run's daemon fills it
    cached, unknown = cached_sources(cache_dir)
    foreign = [found for found in cached if not is_among(found, config)]
    if foreign:
        held = ", ".join(f"{found.samples:,} samples of {found.source}" for found in foreign)
        problem = (f"cache.dir {cache_dir} holds {held}, not among this run's sources "
                   f"({describe(ours)})")
        if not allowed:
            raise ConfigError(f"{problem}; give this run a cache.dir of its own, or delete "
                              f"{cache_dir} to fill it anew from this run's sources, or set "
                              f"{ALLOW}: true to train on them too")
        log.warning("%s: training on them too (%s: true)", problem, ALLOW)
    if unknown:
        log.info("cache.dir %s: %d cached samples have no recorded source (put through the "
                 "Python API, or cached by an older version): not checked against this run's "
                 "sources", cache_dir, unknown)


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
