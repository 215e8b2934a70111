"""A run trains on its own sources: `check_run_sources`, before it starts or attaches a daemon.

``epochcache run`` attaches to the daemon filling ``cache.dir`` when there is one, and trains on
whatever the cache holds: a run configured for dataset B trained on dataset A's samples when
A's daemon filled the directory, or had filled it before. So before anything starts, the run
compares its sources with the cache's (`epochcache.ingest.lineage`: what decides which
objects are read, not credentials, names or weights):

* a daemon filling the cache now must fill it from exactly the run's sources (the run would
  not start its own: nothing else would ever be fetched);
* every sample the cache holds must come from one of the run's sources (its origin names the
  listing it was picked from). Samples with no recorded origin (put through the Python API,
  or cached by a version before origins) cannot be judged, and are let through with a line
  in the log.

Otherwise the run refuses to start (a `ConfigError`: exit 2) naming both and saying how to
proceed, unless ``train.allow_other_sources: true`` says that is what the user wants.
"""

from __future__ import annotations

import logging
import os

from ..config import EpochcacheConfig
from ..errors import ConfigError
from ..ingest.lineage import cached_sources, config_sources, daemon_sources, describe, is_among

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
