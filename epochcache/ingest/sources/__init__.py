"""Remote sources: enumerate and fetch the samples of a dataset on any fsspec URL.

``open_source(spec)`` returns a :class:`Source` for the spec's layout; ``list_keys_cached``
lists through the listing cache in the cache directory. Sources take a :class:`SourceSpec`,
never the run config: :mod:`epochcache.ingest.from_config` converts at the edge.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from .base import CHECKS, FetchResult, Payload, SampleRef, Source, SourceSpec
from .files import FilesSource
from .listing import load_listing, save_listing, source_fingerprint
from .tar import TarSource

__all__ = [
    "CHECKS",
    "FetchResult",
    "FilesSource",
    "Payload",
    "SampleRef",
    "Source",
    "SourceSpec",
    "TarSource",
    "list_keys_cached",
    "load_listing",
    "open_source",
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
    """The :class:`Source` for ``spec.layout`` (nothing is listed or fetched yet).

    Args:
        spec: where the dataset is and how to read it.
        concurrency: requests in flight per ``fetch_many`` call (``sampler.concurrency``).
        checks: content checks; defaults to ``spec.checks``, ``()`` disables them.
        bandwidth_limit: average bytes/s for this process's reads (None: unlimited).

    Raises:
        SourceUnavailable: the URL's protocol cannot be opened.
    """
    kind = TarSource if spec.layout == "tar" else FilesSource
    return kind(spec, concurrency=concurrency, checks=checks, bandwidth_limit=bandwidth_limit)


def list_keys_cached(
    source: Source, cache_dir: str | os.PathLike[str], *, max_age_s: float | None = None
) -> list[SampleRef]:
    """``source.list_keys()``, reusing the listing saved in ``cache_dir`` when it is still valid."""
    fingerprint = source_fingerprint(source.spec)
    refs = load_listing(cache_dir, fingerprint, max_age_s=max_age_s)
    if refs is not None:
        log.info("%s: reusing the saved listing of %d refs", source.url, len(refs))
        return refs
    refs = source.list_keys()
    save_listing(cache_dir, fingerprint, refs)
    return refs
