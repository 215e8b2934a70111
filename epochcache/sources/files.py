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

    def fetch_many(self, refs: Sequence[SampleRef]) -> list[FetchResult]:
        paths = [self.object_path(ref.key) for ref in refs]
        urls = {path: self.object_url(ref.key) for path, ref in zip(paths, refs)}
        fetched = fetch_many(
            self.fs,
            paths,
            concurrency=self.concurrency,
            timeout_s=self.config.timeout_s,
            url_of=urls.__getitem__,
        )
        results: list[FetchResult] = []
        for ref, (_, value) in zip(refs, fetched):
            if isinstance(value, BaseException):
                if not isinstance(value, SourceError):  # fetch_many translates; keep the contract
                    value = SourceError(f"{self.object_url(ref.key)}: {value}", self.object_url(ref.key))
                results.append((ref, value))
                continue
            try:
                check_object(
                    ref.key,
                    value,
                    size=ref.size,
                    checksum=ref.checksum,
                    checks=self.config.checks,
                    url=self.object_url(ref.key),
                )
            except CorruptSample as exc:
                logger.warning("%s: corrupt: %s", self.object_url(ref.key), exc)
                results.append((ref, exc))
                continue
            results.append((ref, value))
        return results
