"""Remote sources: enumerate and fetch the samples of a dataset on any fsspec URL.

``open_source(spec)`` returns a `Source` for the spec's layout; ``listing_cached``
lists through the listing cache in the cache directory (page by page, saved as it goes and
resumed: `paging`), and ``relist`` lists again and appends what is new to it
(``source.listing_ttl_s``). Listings are held as compact `KeyTable` arrays, not an
object per key. Sources take a `SourceSpec`, never the run config:
`epochcache.ingest.from_config` converts at the edge.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from ..keytable import KeyTable, KeyTableBuilder
from ..listing import (
    Listing,
    listing_path,
    merge_listing,
    read_listing,
    read_listing_header,
    save_listing,
    source_fingerprint,
)
from ..paging import PagedListing
from ..types import CHECKS, STREAMED, FetchResult, Payload, Piece, SampleRef, SourceSpec
from .base import Source
from .files import FilesSource
from .lookup import layout_of, layouts
from .tar import TarSource

__all__ = [
    "CHECKS",
    "FetchResult",
    "FilesSource",
    "KeyTable",
    "KeyTableBuilder",
    "Listing",
    "PagedListing",
    "Payload",
    "Piece",
    "STREAMED",
    "SampleRef",
    "Source",
    "SourceSpec",
    "TarSource",
    "layout_of",
    "layouts",
    "list_keys_cached",
    "listing_cached",
    "listing_for_sampling",
    "listing_path",
    "merge_listing",
    "open_source",
    "read_listing",
    "read_listing_header",
    "relist",
    "save_listing",
    "source_fingerprint",
]

log = logging.getLogger(__name__)


def open_source(
    spec: SourceSpec,
    *,
    concurrency: int = 16,
    checks: Sequence[str] | None = None,
    bandwidth_limit: float | None = None,
) -> Source:
    """The `Source` for ``spec.layout`` (nothing is listed or fetched yet).

    Args:
        spec: where the dataset is and how to read it.
        concurrency: requests in flight per ``fetch_many`` call (``sampler.concurrency``).
        checks: content checks; defaults to ``spec.checks``, ``()`` disables them.
        bandwidth_limit: average bytes/s for this process's reads (None: unlimited).

    Raises:
        SourceUnavailable: the URL's protocol cannot be opened.
    """
    kind = layout_of(spec.layout)
    return kind(spec, concurrency=concurrency, checks=checks, bandwidth_limit=bandwidth_limit)


def list_keys_cached(
    source: Source, cache_dir: str | os.PathLike[str], *, max_age_s: float | None = None
) -> list[SampleRef]:
    """``source.list_keys()``, reusing the listing saved in ``cache_dir`` when it is still valid."""
    return listing_cached(source, cache_dir, max_age_s=max_age_s).refs


def listing_cached(
    source: Source, cache_dir: str | os.PathLike[str], *, max_age_s: float | None = None
) -> Listing:
    """The complete `Listing` saved in ``cache_dir`` when it is still valid, else a new
    one, saved. A listing that was saved unfinished is gone on with from where it stopped."""
    fingerprint = source_fingerprint(source.spec)
    listing = read_listing(cache_dir, fingerprint, max_age_s=max_age_s)
    if listing is not None and listing.complete:
        log.info("%s: reusing the saved listing of %d refs", source.url, len(listing))
        return listing
    if source.paged:
        return PagedListing(source, cache_dir).run()
    listing = Listing(source.list_table(), created=time.time())
    save_listing(cache_dir, fingerprint, listing)
    return listing


def listing_for_sampling(source: Source, cache_dir: str | os.PathLike[str]) -> Listing:
    """What a sampler samples: the saved listing, finished or not (the daemon lists and saves
    it before samplers start, and goes on with an unfinished one), else a complete one."""
    listing = read_listing(cache_dir, source_fingerprint(source.spec))
    return listing if listing is not None else listing_cached(source, cache_dir)


def relist(source: Source, cache_dir: str | os.PathLike[str]) -> tuple[Listing, int]:
    """List ``source`` again and merge it into its saved listing (see `merge_listing`);
    return the saved listing and how many keys are new.

    Raises:
        SourceUnavailable: the source cannot be listed (the saved listing is left as it was).
    """
    fingerprint = source_fingerprint(source.spec)
    fresh = source.list_table()
    old = read_listing(cache_dir, fingerprint)
    if old is None or not old.complete:
        listing, added = Listing(fresh, created=time.time()), len(fresh)
    else:
        listing, added = merge_listing(old, fresh)
        if listing.table == old.table and listing.gone == old.gone:
            return old, 0  # unchanged: samplers have nothing to reload
    save_listing(cache_dir, fingerprint, listing)
    return listing, added
