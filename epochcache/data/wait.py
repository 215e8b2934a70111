"""Waiting for the cache to fill: a rich progress bar on a terminal, log lines elsewhere.

A wait that makes no progress says so as a WARNING, which reaches stderr in a plain script
with no logging configured (Python's last-resort handler): after `NO_DAEMON_WARN_S` without a
new sample when no daemon fills the cache, after `STALLED_WARN_S` when one does, and again
every `WARN_EVERY_S` while the count stays put (a wait of 400 s with no daemon printed nothing
at all, issue 37).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..boot import heartbeat_alive
from ..errors import MinSamplesUnreachable

if TYPE_CHECKING:
    from ..store import SampleStore

log = logging.getLogger(__name__)

#: Seconds without a new sample, no daemon filling the cache, before the wait warns.
NO_DAEMON_WARN_S = 5.0
#: Seconds without a new sample before the wait warns while a daemon runs (it lists first).
STALLED_WARN_S = 60.0
#: Seconds between two warnings while the count stays put.
WARN_EVERY_S = 60.0


def wait_for_samples(cache: SampleStore, min_samples: int, timeout_s: float | None = None,
                     poll_s: float = 0.5, judge: Callable[[int], bool] | None = None) -> int:
    """Block until ``cache`` holds ``min_samples`` samples; return how many it holds.

    Args:
        judge: called with the count at every poll: True ends the wait early (with fewer
            samples), an exception ends it with that error (``epochcache run`` passes
            `epochcache.run.startup.FillWatch`).

    Raises:
        TimeoutError: not enough samples after ``timeout_s`` (the message says how many).
        MinSamplesUnreachable: the cache is at its capacity and evicting below min_samples.
    """
    count = cache.counters().samples
    if count >= min_samples:
        return count
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    # With a judge the caller watches the daemon itself (`epochcache run`, which may have just
    # started it): asking whether it runs only puzzled a new user's first run.
    log.info("%s: waiting until %d samples are cached (%d now)%s", cache.path, min_samples,
             count, "" if judge is not None else "; is the daemon running?")
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    progress = Progress("waiting for samples", BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), transient=True, console=Console(stderr=True),
                        disable=not sys.stderr.isatty())
    last_log = since = time.monotonic()  # since: when the count last grew
    warned: float | None = None
    with progress:
        task = progress.add_task("fill", total=min_samples, completed=count)
        while count < min_samples:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{cache.path}: only {count} of min_samples={min_samples} samples cached after "
                    f"{timeout_s:g} s; start `epochcache daemon` or lower train.min_samples"
                )
            time.sleep(poll_s)
            counters = cache.counters()
            now = time.monotonic()
            if counters.samples != count:
                since, warned = now, None
            count = counters.samples
            if count < min_samples and counters.evicted > 0 and counters.bytes >= 0.9 * cache.effective_capacity:
                # Eviction has started: the cache is as full as its capacity lets it get, and
                # waiting longer would wait forever.
                raise MinSamplesUnreachable(
                    f"{cache.path}: min_samples={min_samples} cannot be reached: the cache holds "
                    f"{count} samples at its capacity and has started evicting; lower "
                    "train.min_samples or raise cache.capacity"
                )
            if count < min_samples and judge is not None and judge(count):
                return count
            if count < min_samples and judge is None and (
                    warned is None or now - warned >= WARN_EVERY_S):
                # A run (judge) watches its daemon and ends the wait itself.
                if _warn_if_stuck(cache, count, min_samples, now - since):
                    warned = now
            progress.update(task, completed=min(count, min_samples))
            if time.monotonic() - last_log > 10:
                last_log = time.monotonic()
                log.info("%s: %d/%d samples cached", cache.path, count, min_samples)
    return count


def _warn_if_stuck(cache: SampleStore, count: int, min_samples: int, quiet_s: float) -> bool:
    """Warn that the wait makes no progress, with what to do; whether it warned."""
    if quiet_s < NO_DAEMON_WARN_S:
        return False
    # The daemon's health document (epochcache.ingest.health, which data/ does not import).
    daemon = cache.tables.get_state("daemon")
    age_s = time.time() - float((daemon or {}).get("heartbeat", 0))
    waiting = (f"{cache.path}: waiting for min_samples={min_samples} ({count} cached, none new "
               f"for {quiet_s:.0f} s)")
    if daemon is None or not heartbeat_alive(daemon, age_s):
        log.warning("%s and no daemon is filling this cache: start one (`epochcache daemon "
                    "CONFIG`, or `with epochcache.Daemon(config):` around the loop), fill it "
                    "with cache.put_many(), or lower min_samples (wait_timeout_s= ends the wait "
                    "with an error)", waiting)
        return True
    if quiet_s < STALLED_WARN_S:
        return False
    log.warning("%s although its daemon (pid %s) runs: `epochcache status %s` shows its "
                "samplers' last errors", waiting, daemon.get("pid"), cache.path)
    return True
