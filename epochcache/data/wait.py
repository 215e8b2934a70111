"""Waiting for the cache to fill: a rich progress bar on a terminal, log lines elsewhere."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import MinSamplesUnreachable

if TYPE_CHECKING:
    from ..store import SampleStore

log = logging.getLogger(__name__)


def wait_for_samples(cache: SampleStore, min_samples: int, timeout_s: float | None = None,
                     poll_s: float = 0.5, judge: Callable[[int], bool] | None = None) -> int:
    """Block until ``cache`` holds ``min_samples`` samples; return how many it holds.

    Args:
        judge: called with the count at every poll: True ends the wait early (with fewer
            samples), an exception ends it with that error (``epochcache run`` passes
            `epochcache.run.fill_watch.FillWatch`).

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
    last_log = time.monotonic()
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
            progress.update(task, completed=min(count, min_samples))
            if time.monotonic() - last_log > 10:
                last_log = time.monotonic()
                log.info("%s: %d/%d samples cached", cache.path, count, min_samples)
    return count
