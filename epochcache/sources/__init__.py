"""Remote sources: enumerate and fetch the samples of a dataset on any fsspec URL.

``open_source(config.source)`` returns a :class:`Source` for the configured layout;
``list_keys_cached`` lists through the listing cache in the cache directory.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from epochcache.sources.base import FetchResult, Payload, SampleRef, Source
from epochcache.sources.files import FilesSource
from epochcache.sources.listing import load_listing, save_listing, source_fingerprint
from epochcache.sources.tar import TarSource

if TYPE_CHECKING:
    from epochcache.config import SourceConfig

__all__ = [
    "FetchResult",
    "FilesSource",
    "Payload",
    "SampleRef",
    "Source",
    "TarSource",
    "list_keys_cached",
    "load_listing",
    "open_source",
    "save_listing",
    "source_fingerprint",
]

logger = logging.getLogger(__name__)


def open_source(config: SourceConfig, *, concurrency: int = 16) -> Source:
    """The :class:`Source` for ``config.layout`` (nothing is listed or fetched yet).

    Args:
        config: the ``source`` section of a validated config.
        concurrency: requests in flight per ``fetch_many`` call (``sampler.concurrency``).

    Raises:
        SourceUnavailable: the URL's protocol cannot be opened.
    """
    if config.layout == "tar":
        return TarSource(config, concurrency=concurrency)
    return FilesSource(config, concurrency=concurrency)


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
