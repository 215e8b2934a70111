"""The ``files`` layout: one remote object per sample, selected by a glob under the root URL."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from epochcache.errors import CorruptSample, SourceError
from epochcache.remote import fetch_many
from epochcache.sources.base import FetchResult, SampleRef, Source
from epochcache.sources.check import check_object

logger = logging.getLogger(__name__)


class FilesSource(Source):
    """Objects under ``source.url`` whose path relative to it matches ``source.pattern``.

    The key of a sample is its path relative to the root, so it stays the same when the bucket is
    mounted elsewhere. With ``source.manifest`` the manifest's keys are used instead of a listing.
    """

    layout = "files"
    unit = "sample"

    def list_keys(self) -> list[SampleRef]:
        if self.config.manifest is not None:
            return self._read_manifest()
        return self._list_files(self.config.effective_pattern)

    def fetch_grouped(self, refs: Sequence[SampleRef]) -> list[list[FetchResult]]:
        paths = [self.object_path(ref.key) for ref in refs]
        urls = {path: self.object_url(ref.key) for path, ref in zip(paths, refs)}
        fetched = fetch_many(
            self.fs,
            paths,
            concurrency=self.concurrency,
            timeout_s=self.config.timeout_s,
            url_of=urls.__getitem__,
        )
        self._throttle(sum(len(v) for _, v in fetched if isinstance(v, bytes)))
        groups: list[list[FetchResult]] = []
        for ref, (path, value) in zip(refs, fetched):
            url = urls[path]
            if isinstance(value, BaseException):
                error = (
                    value if isinstance(value, SourceError) else SourceError(f"{url}: {value}", url)
                )
                groups.append([(ref, error)])
                continue
            try:
                check_object(
                    ref.key,
                    value,
                    size=ref.size,
                    checksum=ref.checksum,
                    checks=self.checks,
                    url=url,
                )
            except CorruptSample as exc:
                logger.warning("%s: corrupt: %s", url, exc)
                groups.append([(ref, exc)])
                continue
            groups.append([(ref, value)])
        return groups
