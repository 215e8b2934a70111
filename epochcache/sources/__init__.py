"""Remote sources: enumerate and fetch the samples of a dataset on any fsspec URL.

``open_source(config.source)`` returns a :class:`Source` for the configured layout;
``list_keys_cached`` lists through the listing cache in the cache directory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from epochcache.sources.base import FetchResult, Payload, SampleRef, Source
from epochcache.sources.files import FilesSource
from epochcache.sources.listing import load_listing, save_listing, source_fingerprint
from epochcache.sources.tar import TarSource

if TYPE_CHECKING:
    from epochcache.config import EpochcacheConfig, SourceConfig

__all__ = [
    "FetchResult",
    "FilesSource",
    "Payload",
    "SampleRef",
    "Source",
    "TarSource",
    "list_keys_cached",
    "load_listing",
    "open_configured_source",
    "open_source",
    "save_listing",
    "source_fingerprint",
]

logger = logging.getLogger(__name__)


def open_source(
    config: SourceConfig,
    *,
    concurrency: int = 16,
    checks: Sequence[str] | None = None,
    bandwidth_limit: float | None = None,
) -> Source:
    """The :class:`Source` for ``config.layout`` (nothing is listed or fetched yet).

    Args:
        config: the ``source`` section of a validated config.
        concurrency: requests in flight per ``fetch_many`` call (``sampler.concurrency``).
        checks: content checks; defaults to ``config.checks``, ``()`` disables them.
        bandwidth_limit: average bytes/s for this process's reads (None: unlimited).

    Raises:
        SourceUnavailable: the URL's protocol cannot be opened.
    """
    kind = TarSource if config.layout == "tar" else FilesSource
    return kind(config, concurrency=concurrency, checks=checks, bandwidth_limit=bandwidth_limit)


def open_configured_source(config: EpochcacheConfig) -> Source:
    """The source of a whole config, as one sampler process should open it: ``sampler.concurrency``,
    checks off when ``sampler.check`` is false, and ``sampler.bandwidth_limit`` split evenly among
    ``sampler.processes``."""
    sampler = config.sampler
    limit = sampler.bandwidth_limit / sampler.processes if sampler.bandwidth_limit else None
    return open_source(
        config.source,
        concurrency=sampler.concurrency,
        checks=None if sampler.check else (),
        bandwidth_limit=limit,
    )


def list_keys_cached(
    source: Source, cache_dir: str | os.PathLike[str], *, max_age_s: float | None = None
) -> list[SampleRef]:
    """``source.list_keys()``, reusing the listing saved in ``cache_dir`` when it is still valid."""
    fingerprint = source_fingerprint(source.config)
    refs = load_listing(cache_dir, fingerprint, max_age_s=max_age_s)
    if refs is not None:
        logger.info("%s: reusing the saved listing of %d refs", source.url, len(refs))
        return refs
    refs = source.list_keys()
    save_listing(cache_dir, fingerprint, refs)
    return refs
