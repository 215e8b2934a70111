"""Remote sources: the layouts a source can have, and opening a source of one.

A layout is a `Source` subclass: how its dataset is listed (``list_table``: one ref per
object, or per shard), fetched (``fetch_grouped``: whole objects, a stream, or ranges with
`Source.read_range`) and what a listed ref stands for (``unit``: a sample or a shard of
samples). Names, help and default patterns are in `epochcache.registry` (the config
validates against it); `layout_of` imports a class from there the first time its layout is
used.

``open_source(spec)`` returns a `Source` for the spec's layout; ``listing_cached``
lists through the listing cache in the cache directory (page by page, saved as it goes and
resumed: `paging`), and ``relist`` lists again and appends what is new to it
(``source.listing_ttl_s``). Listings are held as compact `KeyTable` arrays, not an
object per key. Sources take a `SourceSpec`, never the run config: `source_spec` and
`open_configured_source` are the one place that reads the validated config's sections into
them.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import time
from collections.abc import Sequence
from typing import cast

from ...config import EpochcacheConfig, SourceConfig
from ...registry import layout
from ..keytable import KeyTable
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
from ..types import STREAMED, Piece, SampleRef, SourceSpec
from .base import Source

__all__ = [
    "KeyTable",
    "Listing",
    "PagedListing",
    "Piece",
    "STREAMED",
    "SampleRef",
    "Source",
    "SourceSpec",
    "layout_of",
    "listing_cached",
    "listing_for_sampling",
    "listing_path",
    "max_sample_bytes",
    "merge_listing",
    "open_configured_source",
    "open_source",
    "read_listing",
    "read_listing_header",
    "relist",
    "save_listing",
    "source_fingerprint",
    "source_spec",
]

log = logging.getLogger(__name__)


def layout_of(name: str) -> type[Source]:
    """The `Source` class of layout ``name``.

    Raises:
        ValueError: no layout has that name (the message lists those that do).
    """
    module, _, attribute = layout(name).target.partition(":")
    return cast("type[Source]", getattr(importlib.import_module(module), attribute))


def open_source(
    spec: SourceSpec,
    *,
    concurrency: int = 16,
    checks: Sequence[str] | None = None,
    bandwidth_limit: float | None = None,
) -> Source:
    """The `Source` for ``spec.layout``, made with these arguments (see `Source`); nothing
    is listed or fetched yet.

    Raises:
        SourceUnavailable: the URL's protocol cannot be opened.
    """
    kind = layout_of(spec.layout)
    return kind(spec, concurrency=concurrency, checks=checks, bandwidth_limit=bandwidth_limit)


def listing_cached(source: Source, cache_dir: str | os.PathLike[str]) -> Listing:
    """The complete `Listing` saved in ``cache_dir`` when it is still valid, else a new
    one, saved. A listing that was saved unfinished is gone on with from where it stopped."""
    fingerprint = source_fingerprint(source.spec)
    listing = read_listing(cache_dir, fingerprint)
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


def manifest_location(manifest: str | None) -> str | None:
    """A config's ``source.manifest`` as a URL or an absolute path: a relative path is read
    from the working directory, as every relative path of a config is (``cache.dir``,
    ``train.run_dir``, a local ``source.url``); a manifest beside the data is named by its
    URL. (`SourceSpec.manifest` also takes a path relative to the source's URL.)"""
    if manifest is None or "://" in manifest or os.path.isabs(manifest):
        return manifest
    return os.path.abspath(manifest)


def source_spec(config: SourceConfig) -> SourceSpec:
    """The `SourceSpec` of a validated ``source`` section."""
    return SourceSpec(
        url=config.url,
        layout=config.layout,
        pattern=config.pattern,
        shards=config.shards,
        manifest=manifest_location(config.manifest),
        manifest_format=config.manifest_format,
        storage_options=dict(config.storage_options),
        timeout_s=config.timeout_s,
        connect_timeout_s=config.connect_timeout_s,
        list_deadline_s=config.list_deadline_s,
        retries=config.retries,
        checks=tuple(config.checks),
        manifest_max_bytes=config.manifest_max_bytes,
        manifest_max_lines=config.manifest_max_lines,
        client=config.client,
    )


def max_sample_bytes(config: EpochcacheConfig) -> int:
    """The largest sample samplers accept: ``loader.max_sample_bytes``, or the cache capacity
    when smaller (a larger sample could never be cached)."""
    return min(config.loader.max_sample_bytes, config.cache.capacity)


#: Requests in flight of a source opened with ``concurrency: auto`` until a sampler's feed puts
#: its own control in (and the threads of a local source's reader).
AUTO_START_CONCURRENCY = 16


def open_configured_source(config: EpochcacheConfig,
                           section: SourceConfig | None = None) -> Source:
    """A source of a whole config (``section``, default the first), as one sampler process
    opens it: ``sampler.concurrency`` (``auto``: `AUTO_START_CONCURRENCY`; a sampler's
    feed then finds it), checks off when ``sampler.check`` is false, and
    ``sampler.bandwidth_limit`` split evenly among ``sampler.processes`` (a sampler shares its
    limiter among its sources: see ``Sampler``)."""
    sampler = config.sampler
    limit = sampler.bandwidth_limit / sampler.processes if sampler.bandwidth_limit else None
    spec = source_spec(section if section is not None else config.first_source)
    concurrency = sampler.concurrency
    return open_source(
        dataclasses.replace(spec, max_sample_bytes=max_sample_bytes(config),
                            max_range_bytes=sampler.max_bytes_in_flight),
        concurrency=concurrency if isinstance(concurrency, int) else AUTO_START_CONCURRENCY,
        checks=None if sampler.check else (),
        bandwidth_limit=limit,
    )
